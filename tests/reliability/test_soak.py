"""Soak: 8 client processes against one agent with every tier, then a full audit.

The CI form runs 15 s of load. Run it longer with, e.g.

    KVPOOL_SOAK_SECONDS=300 pytest tests/reliability -m soak -p no:timeout

Clients mix lookup, put, get, delete, pin and unpin over DRAM (a small arena, so it
evicts all the time), an NVMe directory (small too: it evicts as well) and a file://
shared tier (write-through, so it holds every chunk). Afterwards: no read returned wrong
bytes, no call failed, every acknowledged chunk is still stored, no lease is left, DRAM
and NVMe used bytes are exactly the chunks they hold, and the agent holds no more file
descriptors than before and no more threads than its worker pools allow.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import psutil
import pytest
import yaml

from kvpool.agent.client import KVPoolClient
from kvpool.agent.store import IO_THREADS, PRESENCE_WAIT_THREADS, READ_THREADS
from kvpool.agent.tiers.shared import LOOKUP_THREADS

from .chunks import chunk_bytes, chunk_key
from .conftest import (
    Load,
    assert_dram_accounted,
    assert_no_wrong_bytes,
    inline_client,
    metric,
    new_agent,
    no_leases,
    settled,
    wait_until,
)

SOAK_SECONDS = float(os.environ.get("KVPOOL_SOAK_SECONDS", "15"))
WORKERS = 8
STORE_POOLS = IO_THREADS + READ_THREADS + PRESENCE_WAIT_THREADS
"""The store's worker threads at most: its write, read and shared-lookup pools."""


def chunk_files(nvme: Path) -> dict[str, int]:
    return {p.name.removesuffix(".kvc"): p.stat().st_size
            for p in nvme.glob("*/*.kvc") if p.parent.name != "quarantine"}


def where(c: KVPoolClient, key: bytes, nvme: Path, shared: Path) -> str:
    """What the agent and its files say of a chunk the audit could not read."""
    name = key.hex()
    return (f"{name}: lookup {c.lookup_tiers([key])}, nvme file "
            f"{[str(q.relative_to(nvme)) for q in nvme.rglob(name + '*')]}, shared object "
            f"{[q.name for q in shared.rglob(name + '*')]}")


def open_files(proc: psutil.Process) -> dict[int, str]:
    """What each of a process's descriptors is open on (a path, socket:[...], anon_inode:...)."""
    out: dict[int, str] = {}
    for fd in os.listdir(f"/proc/{proc.pid}/fd"):
        with contextlib.suppress(OSError):  # closed while listed
            out[int(fd)] = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
    return out


def socket_kinds() -> dict[str, str]:
    """socket:[inode] -> what it is (unix and its path, or tcp and its addresses and state),
    for the message of a descriptor left open."""
    kinds: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            cols = line.split()
            kinds[f"socket:[{cols[6]}]"] = f"unix {cols[7] if len(cols) > 7 else '(unnamed)'}"
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
                cols = line.split()
                kinds[f"socket:[{cols[9]}]"] = f"{name} {cols[1]}->{cols[2]} state {cols[3]}"
    return kinds


@pytest.mark.soak
@pytest.mark.alone  # the load it makes is the test: all of the machine's CPU
def test_soak_eight_clients_over_all_tiers_leaves_nothing_wrong_leaked_or_lost(
        tmp_path: Path, loads: list[Load]) -> None:
    workdir = tmp_path / "agent"
    nvme = workdir / "nvme"
    (tmp_path / "shared").mkdir()
    shared = {"url": (tmp_path / "shared").as_uri()}
    # ~9 MB of chunks through 4 MiB of DRAM and 4 MiB of NVMe: both tiers evict.
    with new_agent(workdir, dram="4Mi", nvme="4Mi", shared=shared, policy={}) as agent:
        assert agent.proc is not None
        proc = psutil.Process(agent.proc.pid)
        idle_fds, idle_threads = proc.num_fds(), proc.num_threads()
        idle_files = open_files(proc)

        load = Load(agent.socket_path, tmp_path / "load", workers=WORKERS, space="soak")
        loads.append(load)
        wait_until(lambda: load.all(lambda s: sum(s["ok"].values()) >= 20), "the load")
        end = time.monotonic() + SOAK_SECONDS  # the load's length, not a threshold
        while time.monotonic() < end and all(p.poll() is None for p in load.procs):
            time.sleep(0.2)  # a worker that dies early ends the soak: finish() reports it
        statuses = load.finish()
        assert_no_wrong_bytes(statuses)
        failed = {e: n for s in statuses for e, n in s["errors"].items()}
        assert not failed, f"client calls failed: {failed}"
        assert all(s["ok"].get(op) for s in statuses
                   for op in ("lookup", "get", "put", "delete", "pin", "unpin"))

        keys = [chunk_key("soak", i) for i in range(WORKERS * load.per_worker)]
        with inline_client(agent) as c:
            wait_until(lambda: no_leases(c) and settled(c), "leases and tier moves to end")
            # Looking must not move chunks while we count them: prefetch off (a hot
            # reload, so the audit also covers the reload path under a full agent).
            (workdir / "policy.yaml").write_text(yaml.safe_dump(
                {"prefetch": {"enabled": False}}))
            wait_until(lambda: metric(agent, "kvpool_policy_reloads_total", result="ok") == 1,
                       "the policy reload")
            assert c.stats()["pins"] == 0  # every worker unpinned what it pinned
            assert_dram_accounted(c, keys)
            on_disk = chunk_files(nvme)
            tier = c.stats()["tiers"]["nvme"]
            assert tier["chunks"] == len(on_disk)
            assert tier["used_bytes"] == sum(on_disk.values())
            assert {k.hex() for k in keys if c.lookup_tiers([k]) == ["nvme"]} == set(on_disk)
            evicted = sum(metric(agent, "kvpool_tier_evictions_total", tier=t, reason=r)
                          for t in ("dram", "nvme") for r in ("capacity", "watermark"))
            assert evicted > 0, "the soak never filled a tier"
            # Write-through put every chunk in the shared tier, and nothing was dropped
            # on the way, so whatever the local tiers evicted is still stored there.
            assert c.stats()["tiers"]["shared"]["queue"]["dropped"] == 0
            acked = load.acked(statuses)
            lost = [k for k in acked if c.get(k) != chunk_bytes(k)]
            assert not lost, f"{len(lost)} acknowledged chunks lost: " + "; ".join(
                where(c, k, nvme, tmp_path / "shared") for k in lost[:3]) + \
                f"\nagent log tail:\n{agent.log()[-3000:]}"
            wait_until(lambda: no_leases(c), "the audit's own leases to end")

        # The audit's connection is closed too: back to the idle agent's descriptors (or
        # fewer: the idle count may have caught a start-up probe's connection in passing).
        try:
            wait_until(lambda: proc.num_fds() <= idle_fds, "file descriptors back to idle",
                       timeout=10)
        except AssertionError as e:
            kinds = socket_kinds()
            extra = {fd: f"{f} {kinds.get(f, '')}".rstrip()
                     for fd, f in open_files(proc).items() if idle_files.get(fd) != f}
            raise AssertionError(f"{e}; open now and not when idle: {extra}") from None
        threads = proc.num_threads()
        assert threads <= idle_threads + STORE_POOLS + LOOKUP_THREADS, \
            f"{threads} threads, {idle_threads} when idle"
        assert metric(agent, "kvpool_leases", kind="read") == 0
        assert metric(agent, "kvpool_leases", kind="write") == 0
        assert metric(agent, "kvpool_integrity_failures_total", tier="dram") == 0
