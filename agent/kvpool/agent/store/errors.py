"""What a client did wrong, as the protocol error code the server answers with."""

from __future__ import annotations

from ..constants import KEY_BYTES
from ..protocol import ErrorCode


class OpError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def check_key(key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise OpError(ErrorCode.BAD_KEY, f"a key is {KEY_BYTES} bytes, got {len(key)}")
