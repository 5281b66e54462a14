"""Real agents, real client processes and the checks every fault test ends with.

`Load` runs `load.py` client processes against an agent; `agent_config` writes the
agent's config (DRAM, an NVMe directory, a shared tier, a hot-reloaded policy file).
The checks after a fault read the agent's own STATS and /metrics, and the files it
keeps, never its internals.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from ..support import scrape
from ..support import wait_until as wait_until  # re-exported for the tests
from .chunks import chunk_bytes, chunk_key, footprint

LOAD = Path(__file__).with_name("load.py")
POOL = "reliability"


def metric(agent: LocalAgent, name: str, **labels: str) -> float:
    """One series' value; labels besides `pool` in alphabetical order, as exported."""
    inner = ",".join(f'{k}="{v}"' for k, v in sorted({"pool": POOL, **labels}.items()))
    return scrape(agent).get(f"{name}{{{inner}}}", 0.0)


def evictions(agent: LocalAgent) -> float:
    return sum(v for k, v in scrape(agent).items()
               if k.startswith("kvpool_tier_evictions_total{"))


def agent_config(workdir: Path, *, nvme: str | None = None, shared: dict[str, Any] | None = None,
                 policy: dict[str, Any] | None = None, **extra: Any) -> Path:
    """agent.yaml in `workdir`: an NVMe tier of size `nvme`, a shared tier, a policy file."""
    tiers: dict[str, Any] = {}
    if nvme is not None:
        tiers["nvme"] = {"path": str(workdir / "nvme"), "size": nvme}
    if shared is not None:
        tiers["shared"] = shared
    cfg: dict[str, Any] = {"pool": POOL, "tiers": tiers, **extra}
    if policy is not None:
        (workdir / "policy.yaml").write_text(yaml.safe_dump(policy))
        cfg["policyFile"] = str(workdir / "policy.yaml")
    path = workdir / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def new_agent(workdir: Path, dram: str = "32Mi", **cfg: Any) -> LocalAgent:
    """An agent (not started yet: `with new_agent(...) as agent:`) with its config."""
    workdir.mkdir(exist_ok=True)
    return LocalAgent("--no-lock", "--config", str(agent_config(workdir, **cfg)),
                      workdir=workdir, dram=dram)


class Load:
    """`workers` client processes running `load.py` against one agent socket."""

    def __init__(self, socket_path: Path, root: Path, *, workers: int, space: str,
                 keys_per_worker: int = 48, max_ops: int = 1_000_000, **settings: Any) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.stop_file = root / "stop"
        self.space, self.workers, self.per_worker = space, workers, keys_per_worker
        self.procs: list[subprocess.Popen[bytes]] = []
        for w in range(workers):
            cfg = {"socket": str(socket_path), "status": str(root / f"worker-{w}.json"),
                   "stop": str(self.stop_file), "worker": w, "workers": workers,
                   "space": space, "keys_per_worker": keys_per_worker, "max_ops": max_ops,
                   **settings}
            log = (root / f"worker-{w}.log").open("wb")
            self.procs.append(subprocess.Popen(
                [sys.executable, str(LOAD), json.dumps(cfg)], cwd=LOAD.parent,
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            log.close()

    def statuses(self) -> list[dict[str, Any]]:
        out = []
        for w in range(self.workers):
            try:
                out.append(json.loads((self.root / f"worker-{w}.json").read_text()))
            except (OSError, ValueError):
                out.append({})
        return out

    def all(self, cond: Callable[[dict[str, Any]], bool]) -> bool:
        return all(s and cond(s) for s in self.statuses())

    def ops(self) -> int:
        return sum(sum(s.get("ok", {}).values()) for s in self.statuses())

    def progressed(self, since: list[dict[str, Any]], ops: int = 30) -> bool:
        """Every worker has made `ops` more successful calls than in `since`."""
        return all(sum(n.get("ok", {}).values()) >= sum(b.get("ok", {}).values()) + ops
                   for n, b in zip(self.statuses(), since, strict=True))

    def logs(self) -> str:
        return "\n".join((self.root / f"worker-{w}.log").read_text(errors="replace")
                         for w in range(self.workers))

    def finish(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Ask every worker to stop and wait for its final report."""
        self.stop_file.touch()
        for proc in self.procs:
            proc.wait(timeout=timeout)
        statuses = self.statuses()
        assert all(s.get("done") for s in statuses), f"a worker did not finish:\n{self.logs()}"
        assert all(proc.returncode == 0 for proc in self.procs), self.logs()
        return statuses

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)

    def acked(self, statuses: list[dict[str, Any]]) -> list[bytes]:
        """Keys whose last mutation was an acknowledged put: they must still be stored."""
        return [chunk_key(self.space, i) for s in statuses for i in s["acked"]]

    def deleted(self, statuses: list[dict[str, Any]]) -> list[bytes]:
        """Keys whose last mutation was an acknowledged delete: they must stay misses."""
        return [chunk_key(self.space, i) for s in statuses for i in s["deleted"]]


@pytest.fixture
def loads() -> Iterator[list[Load]]:
    """Loads started by a test: killed at the end, whatever happened."""
    started: list[Load] = []
    yield started
    for load in started:
        load.kill()


def assert_no_wrong_bytes(statuses: list[dict[str, Any]]) -> None:
    wrong = [w for s in statuses for w in s["wrong"]]
    assert not wrong, f"reads returned wrong bytes for {wrong[:5]}"


def assert_stored(client: KVPoolClient, keys: list[bytes]) -> None:
    """Every key is stored, with its bytes."""
    missing = [k.hex() for k in keys if client.get(k) != chunk_bytes(k)]
    assert not missing, f"{len(missing)} acknowledged chunks lost, e.g. {missing[:3]}"


def no_leases(client: KVPoolClient) -> bool:
    leases = client.stats()["leases"]
    return bool(leases["read"] == 0 and leases["write"] == 0)


def settled(client: KVPoolClient) -> bool:
    """No chunk on its way to NVMe or the shared tier, no NVMe file left to remove."""
    tiers = client.stats()["tiers"]
    nvme = tiers.get("nvme", {})
    if nvme.get("inflight", 0) or nvme.get("removing", 0):
        return False
    queue = tiers.get("shared", {}).get("queue") or {}
    return not queue.get("pending", 0) and not queue.get("in_flight", 0)


def alive(agent: LocalAgent) -> bool:
    return agent.proc is not None and agent.proc.poll() is None


def inline_client(agent: LocalAgent, **kw: Any) -> KVPoolClient:
    return KVPoolClient(agent.socket_path, mode="inline", **kw)


def assert_dram_accounted(client: KVPoolClient, keys: list[bytes]) -> None:
    """DRAM holds whole pages of exactly the chunks LOOKUP finds there: no arena bytes
    leaked by a lease, an aborted write or a fault (call with no client mid-write)."""
    in_dram = [k for k in keys if client.lookup_tiers([k]) == ["dram"]]
    dram = client.stats()["tiers"]["dram"]
    assert dram["chunks"] == len(in_dram)
    assert dram["used_bytes"] == sum(footprint(k) for k in in_dram)

