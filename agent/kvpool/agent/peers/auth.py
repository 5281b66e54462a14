"""The pool-secret handshake: both sides prove they hold the pool's secret before any
chunk or inventory moves.

Each side sends a fresh 32-byte nonce and its agent id; the server answers with an
HMAC-SHA256 over both nonces and both ids (labelled "server"), the client checks it in
constant time and answers with its own (labelled "client"), which the server checks
likewise. Neither proof can be replayed (each covers the other side's fresh nonce) or
reflected (the labels differ). The secret itself never crosses the wire. What it does
not give: confidentiality of the bytes, or protection against a relay between two real
agents; TLS (`peers.tls`) gives both (docs/cross-node.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from . import wire

NONCE_BYTES = 32
MIN_SECRET_BYTES = 16


class AuthError(Exception):
    """The other side did not prove the pool's secret (or broke the handshake)."""


def read_secret(path: Path) -> bytes:
    """The pool's secret from its file (surrounding whitespace ignored); ValueError when it
    is too short to be one."""
    secret = path.read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{path}: a pool secret needs at least {MIN_SECRET_BYTES} bytes, "
                         f"it holds {len(secret)}")
    return secret


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def hello(agent_id: bytes, my_nonce: bytes) -> bytes:
    return wire.HELLO.pack(wire.MAGIC, wire.VERSION, agent_id, my_nonce)


def parse_hello(data: bytes) -> tuple[bytes, bytes]:
    """(agent id, nonce) of the other side's HELLO."""
    magic, version, agent_id, their_nonce = wire.HELLO.unpack(data)
    if magic != wire.MAGIC:
        raise AuthError("not a kvpool peer (bad magic)")
    if version != wire.VERSION:
        raise AuthError(f"peer protocol version {version}, this agent speaks {wire.VERSION}")
    return bytes(agent_id), bytes(their_nonce)


def proof(secret: bytes, label: bytes, client_nonce: bytes, server_nonce: bytes,
          client_id: bytes, server_id: bytes) -> bytes:
    msg = b"kvpool-peer/" + label + client_nonce + server_nonce + client_id + server_id
    return hmac.new(secret, msg, hashlib.sha256).digest()


def check(expected: bytes, got: bytes) -> None:
    if not hmac.compare_digest(expected, got):
        raise AuthError("the pool secret's proof does not match")
