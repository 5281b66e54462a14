"""A read lease protects the bytes it points at, even when the read itself fills DRAM."""

from __future__ import annotations

from pathlib import Path

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient

from .chunks import PAGE, chunk_key
from .conftest import inline_client, new_agent, settled, wait_until

SIZE = 4 * PAGE - 100
"""Four arena pages each: the arena's fill level moves in known steps."""


def data(key: bytes) -> bytes:
    return (key * (SIZE // len(key) + 1))[:SIZE]


def test_chunk_promoted_by_a_read_is_not_evicted_before_its_lease(tmp_path: Path) -> None:
    # LRU by the seq of a chunk's last LOOKUP: a chunk looked up long ago and read now
    # comes up into DRAM as the oldest there, the watermark's first victim.
    policy = {"prefetch": {"enabled": False}, "tiers": {"dram": {"eviction": "lru"}}}
    with new_agent(tmp_path / "agent", dram="1Mi", nvme="64Mi", policy=policy) as agent, \
            inline_client(agent) as c, KVPoolClient(agent.socket_path) as reader:
        old = chunk_key("lease", 0)
        assert c.put(old, data(old))
        fillers = iter(range(1, 10_000))
        for _ in range(80):  # 320 pages through a 256-page arena: `old` goes down to NVMe
            k = chunk_key("lease", next(fillers))
            c.put(k, data(k))
        wait_until(lambda: settled(c), "the demotion")
        assert c.lookup_tiers([old]) == ["nvme"]
        for _ in range(80):  # every chunk in DRAM is newer than that LOOKUP
            k = chunk_key("lease", next(fillers))
            c.put(k, data(k))
        dram = c.stats()["tiers"]["dram"]
        # Fill DRAM until promoting `old` takes it over the high watermark (0.98).
        while dram["used_bytes"] + 4 * PAGE <= 0.98 * dram["capacity_bytes"]:
            k = chunk_key("lease", next(fillers))
            c.put(k, data(k))
            dram = c.stats()["tiers"]["dram"]

        lease = reader._call(p.Acquire(1, old))  # zero-copy read: a lease on arena extents
        assert isinstance(lease, p.AcquireReply)
        assert c.lookup_tiers([old]) == ["dram"], "the leased chunk was evicted"
        for _ in range(40):  # new chunks take whatever arena pages are free
            k = chunk_key("lease", next(fillers))
            c.put(k, data(k))
        arena = reader._arena
        assert arena is not None
        got = b"".join(bytes(arena[o : o + n]) for o, n in lease.extents)
        assert got == data(old)
        reader._call(p.Release(2, lease.lease))
