"""Chunk keys: what makes a cached prefix safe to reuse.

A chunk key is a chained hash over the token ids of consecutive chunks,
seeded with a *layout fingerprint* (model, dtype, layers, KV heads, head dim,
chunk tokens, tenant)::

    key_0 = H(fingerprint_digest || tokens_0)
    key_i = H(key_{i-1} || tokens_i)

so a key names a whole prefix, not just its last chunk, and two requests
share a key only if they share the layout, the tenant and every token before
it. H is XXH3-128 over a fixed little-endian encoding (hash scheme
`KEY_SCHEME`); keys are therefore identical across processes, machines and
releases. Changing any of that is a new scheme name, never a silent change.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

KEY_SCHEME = "kvpool-chain-xxh3-128-v1"
_FINGERPRINT_DOMAIN = b"kvpool/fingerprint/v1\x00"
_BLOCK_DOMAIN = b"kvpool/block/v1\x00"


def length_prefixed(domain: bytes, *texts: str) -> bytes:
    """`domain` then each text as UTF-8 behind its u32 LE length: no two lists of texts
    encode alike, and no two domains collide (each ends in NUL)."""
    out = bytearray(domain)
    for text in texts:
        raw = text.encode()
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


def domain_key(domain: bytes, *texts: str) -> bytes:
    """A chunk key named by `texts` in `domain`: XXH3-128 of their length-prefixed encoding.

    The engine integrations key their chunks this way (LMCache's key string, SGLang's
    page hash, each with the tenant), in a domain of their own.
    """
    return xxhash.xxh3_128_digest(length_prefixed(domain, *texts))


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """The KV layout a chunk was computed for; chunks never cross fingerprints."""

    model: str
    dtype: str
    layers: int
    kv_heads: int
    head_dim: int
    chunk_tokens: int
    tenant: str = ""

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Fingerprint.{name} must be positive")

    def canonical(self) -> bytes:
        """Unambiguous encoding: each field length-prefixed, integers as u32 LE."""
        out = length_prefixed(_FINGERPRINT_DOMAIN, self.model, self.dtype, self.tenant)
        out += struct.pack("<4I", self.layers, self.kv_heads, self.head_dim, self.chunk_tokens)
        return out

    def digest(self) -> bytes:
        """16-byte id of the layout; the seed of every key chain."""
        return xxhash.xxh3_128_digest(self.canonical())

    def fingerprint_id(self) -> int:
        """64-bit id stored in chunk headers (G3/G4) to tell layouts apart."""
        return int.from_bytes(self.digest()[:8], "little")

    def chunk_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one chunk's K and V for all layers, given the dtype's width."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.chunk_tokens * dtype_bytes


def _tokens_le(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of the chunk of `tokens` after the chunk keyed `parent` (the first chunk's
    parent is the fingerprint's digest): `H(parent || tokens)`. For a caller that extends
    a prefix's keys as its tokens arrive; `chunk_keys` computes a whole prefix's."""
    return xxhash.xxh3_128_digest(parent + _tokens_le(tokens))


def chunk_keys(
    fingerprint: Fingerprint, token_ids: Sequence[int], *, include_partial: bool = False
) -> list[bytes]:
    """Keys of the consecutive chunks of `token_ids` (full chunks; the tail if asked)."""
    n = fingerprint.chunk_tokens
    keys: list[bytes] = []
    parent = fingerprint.digest()
    end = len(token_ids) if include_partial else len(token_ids) - len(token_ids) % n
    for start in range(0, end, n):
        parent = chain_key(parent, token_ids[start : start + n])
        keys.append(parent)
    return keys


def block_keys(fingerprint: Fingerprint, block_ids: Iterable[int]) -> list[bytes]:
    """Keys for a trace's prefix block ids (already prefix-unique), one per block."""
    seed = fingerprint.digest()
    return [
        xxhash.xxh3_128_digest(_BLOCK_DOMAIN + seed + struct.pack("<Q", b)) for b in block_ids
    ]
