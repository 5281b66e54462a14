"""What a kvpool chunk of vLLM KV is: its tokens, its keys, its bytes (pure, no vLLM import).

A chunk is `chunk_tokens` tokens, a whole number of vLLM blocks. Its key is kvpool's chained
key (`kvpool.agent.keys`, scheme `KEY_SCHEME`) over the chunk's token ids, seeded with a
fingerprint of everything that makes two engines' KV for those tokens the same bytes: the
model, the KV dtype, the layers, KV heads and head sizes, the tensor- and pipeline-parallel
rank and size, the byte format below, and the tenant. vLLM's own block hashes depend on its
hash algorithm and seed; these keys do not, so they are the same in every process, after a
restart and across vLLM releases that keep the format.

Byte format (`FORMAT`): for each attention layer in the model's order, for each vLLM block
of the chunk in token order, the block's KV in vLLM's logical per-layer order
[KV heads, block tokens, K then V head dims] (vLLM 0.32's [B, H, N, C] cache view with C the
key and value head dims together). Copied straight between the engine's KV tensors and the
arena as one segment per layer and block where vLLM's physical layout keeps that contiguous
(its default `LBHNC`), in smaller contiguous pieces otherwise: the bytes are the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from ...keys import Fingerprint, chain_key

KEY_SCHEME = "kvpool-vllm-chain-xxh3-128-v1"
FORMAT = "vllm-bhnc-v1"
_META_SCHEME = "vllm/v1"


class ChunkTokensError(ValueError):
    """The pool's chunk size does not suit the engine (not a whole number of its blocks)."""


def check_chunk_tokens(chunk_tokens: int, block_size: int) -> int:
    """`chunk_tokens` when it is a positive multiple of vLLM's block size; else one clear error
    (the engine does not start: a chunk must be whole vLLM blocks)."""
    if chunk_tokens <= 0 or block_size <= 0 or chunk_tokens % block_size:
        raise ChunkTokensError(
            f"kvpool: the pool's chunk size (KVPOOL_CHUNK_TOKENS / chunk_tokens = "
            f"{chunk_tokens}) must be a positive multiple of vLLM's block size "
            f"({block_size}): a chunk is a whole number of vLLM blocks. Set the pool's "
            f"chunkTokens, or vLLM's --block-size, so that it divides the chunk size.")
    return chunk_tokens


@dataclass(frozen=True, slots=True)
class Layout:
    """One engine's KV as the pool keys it: the same in the scheduler and in every worker."""

    model: str
    dtype: str
    """The KV cache dtype, e.g. "float32", or "uint8/fp8_e4m3" for a quantised cache."""
    layers: int
    kv_heads: int
    """KV heads on one tensor-parallel rank."""
    head_size: int
    head_size_v: int
    block_size: int
    chunk_tokens: int
    tp_size: int = 1
    pp_size: int = 1
    tenant: str = ""

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    def fingerprint(self, tp_rank: int = 0, pp_rank: int = 0) -> Fingerprint:
        """The layout fingerprint of one rank's chunks (each rank holds its own heads)."""
        model = "\n".join([self.model, FORMAT, f"head_size_v={self.head_size_v}",
                           f"tp={tp_rank}/{self.tp_size}", f"pp={pp_rank}/{self.pp_size}"])
        return Fingerprint(model=model, dtype=self.dtype, layers=self.layers,
                           kv_heads=self.kv_heads, head_dim=self.head_size,
                           chunk_tokens=self.chunk_tokens, tenant=self.tenant)

    def ranks(self) -> list[tuple[int, int]]:
        """Every (tp rank, pp rank) of the engine: a chunk is usable when all of them hold it."""
        return [(t, q) for q in range(self.pp_size) for t in range(self.tp_size)]


class KeyChain:
    """One rank's keys of one request's whole chunks, extended as its tokens grow."""

    __slots__ = ("_seed", "chunk_tokens", "keys")

    def __init__(self, fingerprint: Fingerprint) -> None:
        self.chunk_tokens = fingerprint.chunk_tokens
        self._seed = fingerprint.digest()
        self.keys: list[bytes] = []

    def upto(self, token_ids: list[int] | tuple[int, ...], chunks: int) -> list[bytes]:
        """The keys of the first `chunks` whole chunks of `token_ids` (which must hold them)."""
        n = self.chunk_tokens
        while len(self.keys) < chunks:
            i = len(self.keys)
            parent = self.keys[-1] if self.keys else self._seed
            self.keys.append(chain_key(parent, token_ids[i * n : (i + 1) * n]))
        return self.keys[:chunks]


def engine_hash(block_hash: bytes | int) -> int:
    """vLLM's block hash as its KV events publish it (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`,
    on by default): the hash's last 8 bytes as an unsigned big-endian integer."""
    if isinstance(block_hash, int):
        return block_hash & ((1 << 64) - 1)
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


class ChunkMeta(msgspec.Struct, array_like=True, frozen=True):
    """Stored with each chunk: what its bytes are, checked before a load uses them."""

    scheme: str
    format: str
    dtype: str
    block_shape: list[int]
    """One block of one layer, logical [KV heads, block tokens, K+V head dims]."""
    layers: int
    blocks: int


_meta_decoder = msgspec.msgpack.Decoder(ChunkMeta)


def chunk_meta(layout: Layout, block_shape: list[int]) -> bytes:
    return msgspec.msgpack.encode(ChunkMeta(_META_SCHEME, FORMAT, layout.dtype, block_shape,
                                            layout.layers, layout.blocks_per_chunk))


def meta_matches(raw: bytes, expected: bytes) -> bool:
    """Whether a stored chunk's metadata is the one this engine writes (else: not loaded)."""
    if raw == expected:  # the same encoding: no decoding (a load asks this for every chunk)
        return True
    try:
        return _meta_decoder.decode(raw) == _meta_decoder.decode(expected)
    except msgspec.MsgspecError:
        return False


def chunk_nbytes(block_shape: list[int], itemsize: int, layers: int, blocks: int) -> int:
    return math.prod(block_shape) * itemsize * layers * blocks
