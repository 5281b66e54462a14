"""What an event says of a chunk: the engine blocks its storing client named, else its key.

Kept per chunk while any tier holds it, packed (about 4 bytes per token and 8 per
block hash); turned into event fields only in the publisher's thread.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from ..protocol import ErrorCode
from ..store.errors import OpError


@dataclass(frozen=True, slots=True)
class Identity:
    """What a client said of a chunk it stored, packed (about 4 bytes per token)."""

    hashes: array[int]
    parent: int | None
    tokens: array[int]
    block_size: int
    model: str


def own_hash(key: bytes) -> int:
    """kvpool's stand-in for an engine block hash: the key's first 8 bytes, unsigned."""
    return int.from_bytes(key[:8], "big")


def identity(hashes: list[int], tokens: list[int], parent: int | None, block_size: int,
             model: str) -> Identity | None:
    """A chunk's identity from a PUT/COMMIT and its client's HELLO; None when neither
    says anything. Raises `OpError` (BAD_ARGUMENT) for values no event can carry."""
    if not (hashes or block_size or model):
        return None
    try:
        packed = array("Q", hashes) if min(hashes, default=0) >= 0 else array("q", hashes)
        toks = array("L", tokens)
    except OverflowError as e:
        raise OpError(ErrorCode.BAD_ARGUMENT,
                      f"block hashes must fit 64 bits and token ids 32 bits: {e}") from None
    if parent is not None and not -(1 << 63) <= parent < 1 << 64:
        raise OpError(ErrorCode.BAD_ARGUMENT, "parent_block_hash must fit 64 bits")
    return Identity(packed, parent, toks, block_size, model)


def block_of(key: bytes, ident: Identity | None) -> tuple[list[int], int | None, list[int], int]:
    """(block hashes, parent hash, token ids, block size) of a chunk's events."""
    if ident is None:
        return [own_hash(key)], None, [], 0
    if not ident.hashes:  # kvpool's own key: one block for the whole chunk
        return [own_hash(key)], None, [], ident.block_size
    return ident.hashes.tolist(), ident.parent, ident.tokens.tolist(), ident.block_size


def model_of(ident: Identity | None) -> str:
    return ident.model if ident is not None else ""
