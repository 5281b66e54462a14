"""Replay a request trace through a client: the workload of demo and bench.

Each request looks up its blocks' keys (longest stored prefix), reads the
hits and writes the misses, the way an inference engine with a KV-cache
connector would: a batch per request (`get_many_into`, `put_many`), a few
round trips whatever its length. Every block's bytes are derived from its key, so every read
is checked against what was written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.agent.client import KVPoolClient
from kvpool.agent.keys import Fingerprint, block_keys

from .trace import TraceRequest

DEMO_FINGERPRINT = Fingerprint(
    model="mooncake-trace", dtype="bfloat16", layers=1, kv_heads=1, head_dim=128,
    chunk_tokens=512, tenant="demo",
)


def block_payload(key: bytes, size: int) -> bytes:
    return (key * (size // len(key) + 1))[:size]


@dataclass
class ReplayResult:
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    wrong_bytes: int = 0
    """Reads whose bytes differed from what was written: must stay 0."""
    seconds: float = 0.0
    hits_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def block_hit_ratio(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0


def replay(
    client: KVPoolClient,
    trace: list[TraceRequest],
    block_bytes: int,
    fingerprint: Fingerprint = DEMO_FINGERPRINT,
    on_request: Callable[[ReplayResult], None] | None = None,
) -> ReplayResult:
    """Each request: one LOOKUP, one batched read of the hit prefix, one batched write of
    the rest, as an engine's KV connector does it."""
    res = ReplayResult()
    buf = bytearray()
    started = time.perf_counter()
    for req in trace:
        keys = block_keys(fingerprint, req.blocks)
        tiers = client.lookup_tiers(keys)
        if len(buf) < len(tiers) * block_bytes:
            buf = bytearray(len(tiers) * block_bytes)
        view = memoryview(buf)

        def slot(i: int, size: int, meta: bytes, v: memoryview = view) -> memoryview:
            return v[i * block_bytes : (i + 1) * block_bytes]

        sizes = client.get_many_into(keys[: len(tiers)], slot)
        hits = 0
        for i, (key, n) in enumerate(zip(keys, sizes, strict=False)):
            if n == 0:  # evicted between lookup and read: a miss after all
                break
            if view[i * block_bytes : i * block_bytes + n] != block_payload(key, block_bytes):
                res.wrong_bytes += 1
            res.bytes_read += n
            hits += 1
        # A hit counts for the tier LOOKUP found it in, once it has been read: a chunk
        # evicted between the two is a miss, in the per-tier counts as in `hit_blocks`.
        for tier in tiers[:hits]:
            res.hits_by_tier[tier] = res.hits_by_tier.get(tier, 0) + 1
        misses = keys[hits:]
        stored = client.put_many(misses, [block_payload(k, block_bytes) for k in misses])
        res.bytes_written += block_bytes * sum(1 for r in stored if r is True)
        res.requests += 1
        res.blocks += len(keys)
        res.hit_blocks += hits
        if on_request is not None:
            on_request(res)
    res.seconds = time.perf_counter() - started
    return res
