"""Faults behind the agent's back: a G3 chunk file truncated, the arena file unlinked, the
policy file replaced with garbage. None of them may make the agent serve wrong bytes or
stop serving; each is visible where the docs say (a metric, the log, quarantine/).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from kvpool.agent.client import KVPoolClient

from .chunks import chunk_bytes, chunk_key
from .conftest import (
    Load,
    alive,
    assert_dram_accounted,
    assert_no_wrong_bytes,
    assert_stored,
    inline_client,
    metric,
    new_agent,
    no_leases,
    settled,
    wait_until,
)


def nvme_file(nvme: Path, key: bytes) -> Path:
    """Where G3 keeps a chunk (docs/architecture.md: one file per chunk)."""
    return nvme / key.hex()[:2] / f"{key.hex()}.kvc"


def chunk_files(nvme: Path) -> list[Path]:
    return [p for p in nvme.glob("*/*.kvc") if p.parent.name != "quarantine"]


def assert_nvme_accounted(client: KVPoolClient, nvme: Path) -> None:
    """The NVMe tier's used bytes and chunks are the chunk files on disk."""
    tier = client.stats()["tiers"]["nvme"]
    files = chunk_files(nvme)
    assert tier["chunks"] == len(files)
    assert tier["used_bytes"] == sum(p.stat().st_size for p in files)


NO_PREFETCH = {"prefetch": {"enabled": False}}
"""A LOOKUP that reaches NVMe loads those chunks into DRAM ahead of the reads; the tests
that look where chunks are turn that off, so looking does not move them."""


def test_truncated_nvme_file_is_a_counted_quarantined_miss_running_and_at_restart(
        tmp_path: Path) -> None:
    workdir = tmp_path / "agent"
    nvme = workdir / "nvme"
    keys = [chunk_key("truncated", i) for i in range(60)]
    with new_agent(workdir, dram="1Mi", nvme="64Mi", policy=NO_PREFETCH) as agent, \
            inline_client(agent) as c:
        for k in keys:  # 60 chunks of ~24 KB through a 1 MiB arena: most go down to NVMe
            assert c.put(k, chunk_bytes(k))
        wait_until(lambda: settled(c), "demotions to land")
        on_nvme = [k for k in keys if c.lookup_tiers([k]) == ["nvme"]]
        assert len(on_nvme) >= 10
        read_now, at_restart = on_nvme[0], on_nvme[1]
        cut_data, cut_header = nvme_file(nvme, read_now), nvme_file(nvme, at_restart)
        size_before = cut_data.stat().st_size
        used_before = c.stats()["tiers"]["nvme"]["used_bytes"]
        os.truncate(cut_data, size_before // 2)  # the chunk's tail is gone

        assert c.get(read_now) is None
        assert metric(agent, "kvpool_integrity_failures_total", tier="nvme") == 1
        assert (nvme / "quarantine" / cut_data.name).exists() and not cut_data.exists()
        assert c.lookup_tiers([read_now]) == []
        assert c.stats()["tiers"]["nvme"]["used_bytes"] == used_before - size_before
        for k in on_nvme[2:6]:  # the other chunks of the tier are untouched
            assert c.get(k) == chunk_bytes(k)
        wait_until(lambda: settled(c), "promotions and demotions to land")
        assert_nvme_accounted(c, nvme)

    os.truncate(cut_header, 20)  # while the agent is down: not even a whole header is left
    with new_agent(workdir, dram="1Mi", nvme="64Mi", policy=NO_PREFETCH) as agent, \
            inline_client(agent) as c:
        # The index is rebuilt from the files' headers: the cut one is quarantined at start.
        assert "quarantining" in agent.log()
        assert (nvme / "quarantine" / cut_header.name).exists()
        assert c.lookup_tiers([at_restart]) == [] and c.get(at_restart) is None
        assert_nvme_accounted(c, nvme)
        for k in keys:
            assert c.get(k) in (None, chunk_bytes(k))
        assert c.get(on_nvme[2]) == chunk_bytes(on_nvme[2])


def test_unlinked_arena_keeps_serving_from_its_mapping_and_a_restart_starts_fresh(
        tmp_path: Path, loads: list[Load]) -> None:
    workdir = tmp_path / "agent"
    with new_agent(workdir, dram="4Mi", nvme="64Mi", policy=NO_PREFETCH) as agent:
        load = Load(agent.socket_path, tmp_path / "load", workers=2, space="unlinked")
        loads.append(load)
        wait_until(lambda: load.all(lambda s: sum(s["ok"].values()) >= 50), "the load")

        os.unlink(agent.arena_path)
        ops = load.ops()
        wait_until(lambda: load.ops() >= ops + 200, "the load to go on")
        # A client that connects now still gets the agent's (unlinked) arena with HELLO.
        fresh = chunk_key("unlinked-fresh", 0)
        with KVPoolClient(agent.socket_path) as c:
            assert c.put(fresh, chunk_bytes(fresh))
            assert c.get(fresh) == chunk_bytes(fresh)
        statuses = load.finish()
        assert_no_wrong_bytes(statuses)
        assert not any(s["errors"] for s in statuses), "clients noticed the unlink"
        keys = [fresh, *(chunk_key("unlinked", i) for i in range(2 * load.per_worker))]
        with inline_client(agent) as c:
            wait_until(lambda: no_leases(c) and settled(c), "leases and demotions to end")
            assert_dram_accounted(c, keys)
            below = [k for k in keys if c.lookup_tiers([k]) == ["nvme"]]
        agent.stop(remove_arena=False)

        agent.start()
        assert agent.arena_path.exists()  # a new arena: nothing of the old one to trust
        with KVPoolClient(agent.socket_path) as c:
            dram = c.stats()["tiers"]["dram"]
            assert dram["chunks"] == 0 and dram["used_bytes"] == 0
            assert c.get(fresh) is None
            for k in keys:
                assert c.get(k) in (None, chunk_bytes(k))
            assert_stored(c, below)  # what NVMe held is still served


GARBAGE = [
    b"\xff\xfe\x00\x01\x80 not text at all \xc3\x28",  # e.g. a binary written over it
    b"tiers: {dram: [highWatermark: \n",  # a torn YAML write
    b"- just\n- a list\n",  # YAML, but not a policy
    b"tiers:\n  dram:\n    eviction: fifo-ish\n",  # a policy with a bad value
]


def test_policy_file_replaced_with_garbage_under_load_keeps_the_last_good_policy(
        tmp_path: Path, loads: list[Load]) -> None:
    workdir = tmp_path / "agent"
    pinned, later = chunk_key("policy-pin", 0), chunk_key("policy-pin", 1)
    policy = {"pins": [pinned.hex()], "tiers": {"dram": {"eviction": "lru"}}, **NO_PREFETCH}
    with new_agent(workdir, dram="2Mi", nvme="128Mi", policy=policy) as agent:
        with inline_client(agent) as c:
            assert c.put(pinned, chunk_bytes(pinned)) and c.put(later, chunk_bytes(later))
        # 4 x 48 chunks of ~24 KB through a 2 MiB arena: DRAM evicts all the time, so
        # a pin the policy no longer held would be evicted too.
        load = Load(agent.socket_path, tmp_path / "load", workers=4, space="policy")
        loads.append(load)
        wait_until(lambda: load.all(lambda s: sum(s["ok"].values()) >= 50), "the load")

        policy_file = workdir / "policy.yaml"
        for n, garbage in enumerate(GARBAGE, start=1):
            policy_file.write_bytes(garbage)
            wait_until(lambda n=n: metric(agent, "kvpool_policy_reloads_total",
                                          result="invalid") == n, f"garbage {n} refused")
            ops = load.ops()
            wait_until(lambda ops=ops: load.ops() >= ops + 100, "the load to go on")
        assert alive(agent)

        # Reloading still works after all that garbage: the housekeeping loop survived it.
        policy_file.write_text(yaml.safe_dump({**policy, "pins": [pinned.hex(), later.hex()]}))
        wait_until(lambda: metric(agent, "kvpool_policy_reloads_total", result="ok") == 1,
                   "the good policy to load")
        statuses = load.finish()
        assert_no_wrong_bytes(statuses)
        assert not any(s["errors"] for s in statuses), "clients noticed the garbage"
        with inline_client(agent) as c:
            wait_until(lambda: no_leases(c) and settled(c), "leases and demotions to end")
            assert c.stats()["pins"] == 2  # the new policy's pins, the workers' all undone
            assert c.lookup_tiers([pinned]) == ["dram"]  # never evicted: still pinned
            assert metric(agent, "kvpool_tier_evictions_total", tier="dram",
                          reason="capacity") + metric(
                agent, "kvpool_tier_evictions_total", tier="dram", reason="watermark") > 0
            assert metric(agent, "kvpool_tier_evictions_total", tier="nvme",
                          reason="watermark") == 0
            assert_stored(c, load.acked(statuses))  # evicted from DRAM means demoted
