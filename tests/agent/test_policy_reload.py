"""Policy hot reload in a real agent: applied in place, from a plain file or a ConfigMap mount.

The agent checks its policy file about twice a second (housekeeping); the tests wait for
`kvpool_policy_reloads_total` to count the reload, with a bounded wait.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from .conftest import RawConn, scrape, wait_until

KiB, MiB = 1 << 10, 1 << 20
RELOAD_OK = 'kvpool_policy_reloads_total{pool="default",result="ok"}'
RELOAD_INVALID = 'kvpool_policy_reloads_total{pool="default",result="invalid"}'
HELLOS = 'kvpool_ops_total{op="hello",pool="default",result="ok"}'
CAPACITY_EVICTIONS = 'kvpool_tier_evictions_total{pool="default",reason="capacity",tier="dram"}'
NO_PREFETCH = "prefetch: {enabled: false}\n"


def data_for(key: bytes, size: int) -> bytes:
    return (key * (size // len(key) + 1))[:size]


def write_policy(path: Path, text: str) -> None:
    """Replace the file in one step, as a careful editor or a ConfigMap update does: the
    agent never reads half a file."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def pinning(*keys: bytes, base: str = NO_PREFETCH) -> str:
    """A policy whose effect a client can see: STATS counts the pins."""
    return base + "pins: [" + ", ".join(k.hex() for k in keys) + "]\n"


def reloads(agent: LocalAgent, result: str = "ok") -> float:
    return scrape(agent)[RELOAD_OK if result == "ok" else RELOAD_INVALID]


def wait_for_reload(agent: LocalAgent, n: int = 1, result: str = "ok") -> None:
    # Housekeeping looks every half second: ten seconds is a guard against a hang.
    wait_until(lambda: reloads(agent, result) >= n, timeout=10,
               what=f"policy reload #{n} ({result})")


def test_a_changed_policy_is_applied_without_flushing_tiers_or_dropping_connections(
        tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(NO_PREFETCH)
    with LocalAgent("--no-lock", "--policy", str(policy), "--nvme-dir", str(tmp_path / "nvme"),
                    "--nvme", "64Mi", workdir=tmp_path, dram="4Mi") as agent, \
            KVPoolClient(agent.socket_path) as c:
        keys = [os.urandom(16) for _ in range(24)]
        for k in keys:
            c.put(k, data_for(k, 256 * KiB))
        wait_until(lambda: c.stats()["tiers"]["nvme"]["inflight"] == 0, what="demotions")
        tiers = [c.lookup_tiers([k])[0] for k in keys]
        assert {"dram", "nvme"} == set(tiers)
        raw = RawConn(agent.socket_path)  # holds a read lease across the reload
        dram_key = keys[tiers.index("dram")]
        lease = raw.call(p.Acquire(1, dram_key))
        assert isinstance(lease, p.AcquireReply)
        hellos = scrape(agent)[HELLOS]

        write_policy(policy, pinning(keys[0]))
        wait_for_reload(agent)

        assert c.stats()["pins"] == 1  # applied ...
        assert [c.lookup_tiers([k])[0] for k in keys] == tiers  # ... with every chunk in place
        assert scrape(agent)[HELLOS] == hellos  # the client's connection is the same one
        assert c.stats()["clients"] == 2
        assert isinstance(raw.call(p.Release(2, lease.lease)), p.ReleaseReply)  # lease too
        assert all(c.get(k) == data_for(k, 256 * KiB) for k in keys)
        assert reloads(agent, "invalid") == 0
        raw.close()


def configmap_dir(root: Path, text: str) -> Path:
    """A directory laid out like a mounted ConfigMap: `policy.yaml -> ..data/policy.yaml`,
    `..data -> ..<timestamp>`, the file itself in the timestamped directory."""
    root.mkdir()
    first = root / "..2025_01_01_00_00_00.000000001"
    first.mkdir()
    (first / "policy.yaml").write_text(text)
    (root / "..data").symlink_to(first.name)
    (root / "policy.yaml").symlink_to("..data/policy.yaml")
    return root / "policy.yaml"


def configmap_update(root: Path, text: str) -> None:
    """What the kubelet does on a ConfigMap change: a new timestamped directory, `..data`
    re-pointed in one rename, the old directory removed."""
    old = (root / "..data").resolve()
    new = root / "..2025_01_01_00_01_00.000000002"
    new.mkdir()
    (new / "policy.yaml").write_text(text)
    (root / "..data_tmp").symlink_to(new.name)
    os.replace(root / "..data_tmp", root / "..data")
    shutil.rmtree(old)


def agent_config(tmp_path: Path, policy_file: str) -> Path:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"policyFile: {policy_file}\n")
    return cfg


def swap_is_picked_up(agent: LocalAgent, root: Path) -> None:
    key = os.urandom(16)
    with KVPoolClient(agent.socket_path) as c:
        c.put(key, b"chunk")
        assert c.stats()["pins"] == 0
        configmap_update(root, pinning(key))
        wait_for_reload(agent)
        assert c.stats()["pins"] == 1
        assert c.get(key) == b"chunk"


def test_a_configmap_symlink_swap_is_picked_up(tmp_path: Path) -> None:
    """The operator renders an absolute `policyFile` into the agent's config."""
    root = tmp_path / "config"
    policy = configmap_dir(root, NO_PREFETCH)
    cfg = agent_config(tmp_path, str(policy))
    with LocalAgent("--no-lock", "--config", str(cfg), workdir=tmp_path) as agent:
        swap_is_picked_up(agent, root)


def test_a_configmap_symlink_swap_is_picked_up_with_a_relative_policy_file(
        tmp_path: Path) -> None:
    """A relative `policyFile` is relative to the config file's directory: the ConfigMap's."""
    root = tmp_path / "config"
    configmap_dir(root, NO_PREFETCH)
    cfg = agent_config(root, "policy.yaml")
    with LocalAgent("--no-lock", "--config", str(cfg), workdir=tmp_path) as agent:
        swap_is_picked_up(agent, root)


def test_a_configmap_symlink_swap_is_picked_up_with_the_policy_flag(tmp_path: Path) -> None:
    root = tmp_path / "config"
    policy = configmap_dir(root, NO_PREFETCH)
    with LocalAgent("--no-lock", "--policy", str(policy), workdir=tmp_path) as agent:
        swap_is_picked_up(agent, root)


@dataclass
class Reloading:
    agent: LocalAgent
    policy: Path
    client: KVPoolClient
    key: bytes


@pytest.fixture(scope="module")
def reloading(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reloading]:
    """One agent for the invalid-policy table (each case sets its own last good policy)."""
    workdir = tmp_path_factory.mktemp("reload")
    policy = workdir / "policy.yaml"
    policy.write_text(NO_PREFETCH)
    key = os.urandom(16)
    with LocalAgent("--no-lock", "--policy", str(policy), workdir=workdir) as agent, \
            KVPoolClient(agent.socket_path) as c:
        c.put(key, b"chunk")
        yield Reloading(agent, policy, c, key)


@pytest.mark.parametrize(
    ("bad", "names"),
    [
        pytest.param("tiers: {dram: {highWatermark: 1.5}}\n",
                     "tiers.dram.highWatermark: Input should be less than or equal to 1",
                     id="out-of-range"),
        pytest.param("prefetch: {lookahed: 3}\n", "prefetch.lookahed: unknown field",
                     id="misspelt-field"),
        pytest.param("tiers: {nvme: {eviction: fifo}}\n", "tiers.nvme.eviction: Input should be",
                     id="unknown-eviction-order"),
        pytest.param("tiers: {dram: {lowWatermark: 0.99, highWatermark: 0.9}}\n",
                     "lowWatermark (0.99) must be below highWatermark (0.9)",
                     id="low-above-high"),
        pytest.param("pins: [abc]\n", "pins: Value error, pins[0] 'abc' is not a chunk key",
                     id="bad-pin"),
        pytest.param("tiers: [\n", "not valid YAML", id="not-yaml"),
        # What a file written in place looks like between its truncation and the write.
        pytest.param("", "empty (write {} for the default policy)", id="empty-file"),
    ],
)
def test_an_invalid_policy_keeps_the_last_good_one_and_the_log_names_the_field(
        reloading: Reloading, bad: str, names: str) -> None:
    agent, policy, c = reloading.agent, reloading.policy, reloading.client
    good = pinning(reloading.key)
    ok, invalid = reloads(agent), reloads(agent, "invalid")
    if c.stats()["pins"] != 1:
        write_policy(policy, good)
        wait_for_reload(agent, n=int(ok) + 1)
        ok += 1

    write_policy(policy, bad)
    wait_for_reload(agent, n=int(invalid) + 1, result="invalid")
    assert c.stats()["pins"] == 1  # the last good policy stays
    assert reloads(agent) == ok
    errors = [line for line in agent.log().splitlines() if "policy not reloaded" in line]
    assert len(errors) == invalid + 1 and names in errors[-1], errors[-1:]
    assert "policy.yaml" in errors[-1]  # and the file
    assert c.get(reloading.key) == b"chunk"


def test_a_policy_rewritten_in_place_within_one_clock_tick_is_still_reloaded(
        reloading: Reloading) -> None:
    """Written in place, with the modification time it had (a coarse file clock gives a
    truncation and the write after it the same time): the size still tells them apart."""
    agent, policy, c = reloading.agent, reloading.policy, reloading.client
    write_policy(policy, pinning(reloading.key))
    wait_for_reload(agent, n=int(reloads(agent)) + 1)
    before = policy.stat()
    ok = reloads(agent)
    policy.write_text(pinning(reloading.key, os.urandom(16)))
    os.utime(policy, ns=(before.st_atime_ns, before.st_mtime_ns))
    wait_for_reload(agent, n=int(ok) + 1)
    assert c.stats()["pins"] == 2


def test_a_fixed_policy_file_is_applied_again(reloading: Reloading) -> None:
    agent, policy, c = reloading.agent, reloading.policy, reloading.client
    write_policy(policy, "tiers: {dram: {highWatermark: 7}}\n")
    wait_for_reload(agent, n=int(reloads(agent, "invalid")) + 1, result="invalid")
    ok = reloads(agent)
    write_policy(policy, pinning(reloading.key, os.urandom(16)))
    wait_for_reload(agent, n=int(ok) + 1)
    assert c.stats()["pins"] == 2


def test_changing_the_eviction_order_at_runtime_rebuilds_the_queue(tmp_path: Path) -> None:
    # Watermarks at the top: only a write that does not fit evicts, one chunk at a time.
    rules = "tiers:\n  dram: {{eviction: {order}, highWatermark: 1.0, lowWatermark: 0.99}}\n"
    policy = tmp_path / "policy.yaml"
    policy.write_text(rules.format(order="lru"))
    with LocalAgent("--no-lock", "--policy", str(policy), workdir=tmp_path,
                    dram="8Mi") as agent, KVPoolClient(agent.socket_path) as c:
        keys = [os.urandom(16) for _ in range(8)]
        for k in keys:
            c.put(k, data_for(k, MiB))
        for _ in range(3):  # keys[0]: hit most often, longest ago
            assert c.lookup([keys[0]]) == 1
        for k in keys[1:]:  # the others: hit once, more recently
            assert c.lookup([k]) == 1
        # LRU would now evict keys[0]; LFU evicts keys[1] (fewest hits, least recent).
        write_policy(policy, rules.format(order="lfu"))
        wait_for_reload(agent)

        extra = os.urandom(16)
        assert c.put(extra, data_for(extra, MiB))
        assert scrape(agent)[CAPACITY_EVICTIONS] == 1
        assert c.get(keys[1]) is None
        assert c.get(keys[0]) == data_for(keys[0], MiB)
        assert all(c.get(k) == data_for(k, MiB) for k in [*keys[2:], extra])
