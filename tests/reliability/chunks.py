"""Chunks whose bytes follow from their key, so any process can check any read.

Imported by the tests and by `load.py` (run as a script, so no package-relative imports).
"""

from __future__ import annotations

import hashlib

import xxhash

PAGE = 4096
"""The arena's page: a DRAM chunk takes whole pages."""
MIN_CHUNK = 1000
MAX_CHUNK = 48_000
"""Chunk sizes vary and are rarely page multiples, so the footprint rounding is exercised."""


def chunk_key(space: str, index: int) -> bytes:
    """The 16-byte key of chunk `index` of a test's key space."""
    return xxhash.xxh3_128_digest(f"kvpool-reliability/{space}/{index}".encode())


def chunk_size(key: bytes) -> int:
    return MIN_CHUNK + int.from_bytes(key[:4], "little") % (MAX_CHUNK - MIN_CHUNK)


def chunk_bytes(key: bytes) -> bytes:
    """The only bytes ever written under `key`: a read of anything else is wrong bytes.

    A keyed stream rather than a repeated pattern, so bytes shifted within a chunk or
    taken from another chunk never match by accident.
    """
    return hashlib.shake_128(key).digest(chunk_size(key))


def footprint(key: bytes) -> int:
    """Arena bytes the chunk takes in DRAM."""
    return -(-chunk_size(key) // PAGE) * PAGE
