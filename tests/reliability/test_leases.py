"""Leases: a read lease protects the bytes it points at, even when the read itself fills
DRAM; a client that dies holding leases leaves none behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient

from .chunks import PAGE, chunk_key
from .conftest import inline_client, metric, new_agent, no_leases, settled, wait_until

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


def test_client_killed_holding_read_and_write_leases_leaves_none_behind(tmp_path: Path) -> None:
    with new_agent(tmp_path / "agent", dram="8Mi") as agent, inline_client(agent) as c:
        read_key, written_key = chunk_key("killed", 0), chunk_key("killed", 1)
        assert c.put(read_key, data(read_key))
        base = c.stats()["tiers"]["dram"]["used_bytes"]
        # A real client process: three read leases, a write lease half copied, then SIGKILL.
        script = textwrap.dedent(f"""
            from kvpool.agent import protocol as p
            from kvpool.agent.client import KVPoolClient
            c = KVPoolClient({str(agent.socket_path)!r})
            for rid in range(3):
                c._call(p.Acquire(rid, bytes.fromhex({read_key.hex()!r})))
            a = c._call(p.Alloc(9, bytes.fromhex({written_key.hex()!r}), 1 << 20))
            c._arena[a.extents[0][0]:a.extents[0][0] + 4096] = b"h" * 4096
            print("leased", flush=True)
            input()
        """)
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                stdin=subprocess.PIPE)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == b"leased"
            assert c.stats()["leases"] == {"read": 3, "write": 1}
            assert metric(agent, "kvpool_leases", kind="write") == 1
            proc.kill()
            proc.wait(timeout=30)
        finally:
            proc.kill()
        wait_until(lambda: no_leases(c), "the dead client's leases to end")
        assert c.stats()["tiers"]["dram"]["used_bytes"] == base
        assert metric(agent, "kvpool_leases", kind="read") == 0
        assert c.lookup([written_key]) == 0 and c.get(written_key) is None
        assert c.delete(read_key)  # no lease holds it back: freed at once
        assert c.stats()["tiers"]["dram"]["used_bytes"] == 0
