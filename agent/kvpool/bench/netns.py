"""Agents as separate nodes: network namespaces joined by veth pairs on a bridge (root only:
`ip netns`, iproute2). The peer tier's tests, `kvpool bench --part peer` and the two-node
demo use it.

Each node has its own namespace and address (and the test gives each agent its own
arena, NVMe directory and socket: socket paths are files, reachable across namespaces).
The root namespace has an address on the bridge too, so the test reaches every agent's
metrics and peer port. Names and the /24 derive from the test process's id and a
counter, so parallel test processes never collide; `close` removes everything.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from .local import LocalAgent

_networks = itertools.count()
PEER_PORT = 9410


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass
class Node:
    ns: str
    addr: str
    outer: str
    """The veth end in the root namespace (set down: the node is cut off)."""
    inner: str


class Network:
    def __init__(self, n: int) -> None:
        k = next(_networks)
        pid = os.getpid()
        tag = f"{pid:x}{k:x}"[-8:]
        seed = (pid * 131 + k * 7919) % (128 * 250)
        self.prefix = f"10.{64 + seed // 250}.{1 + seed % 250}"
        self.bridge = f"kvb{tag}"
        self.host = f"{self.prefix}.254"
        self.nodes: list[Node] = []
        self._made: list[list[str]] = []
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(["link", "del", self.bridge])
            ip("addr", "add", f"{self.host}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i in range(n):
                ns = f"kvpool-{tag}-{i}"
                outer, inner = f"kv{tag}o{i}", f"kv{tag}i{i}"
                ip("netns", "add", ns)
                self._made.append(["netns", "del", ns])
                ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                self._made.append(["link", "del", outer])
                ip("link", "set", inner, "netns", ns)
                ip("link", "set", outer, "master", self.bridge, "up")
                addr = f"{self.prefix}.{i + 1}"
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
                ip("-n", ns, "link", "set", inner, "up")
                ip("-n", ns, "link", "set", "lo", "up")
                self.nodes.append(Node(ns, addr, outer, inner))
        except BaseException:
            self.close()
            raise

    def cut(self, node: Node) -> None:
        ip("link", "set", node.outer, "down")

    def heal(self, node: Node) -> None:
        ip("link", "set", node.outer, "up", "master", self.bridge)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for cmd in reversed(self._made):
            subprocess.run(["ip", *cmd], capture_output=True)
        self._made = []


def peer_agent(net: Network, i: int, workdir: Path, secret: Path, *, timeout: str = "10s",
               nvme: bool = True, shared: Path | None = None, dram: str = "32Mi",
               tenants: list[str] | None = None, extra: dict[str, object] | None = None,
               arena: Path | None = None, prefetch: bool = True,
               events: dict[str, object] | None = None, named: bool = False,
               lru: bool = False, shared_tier: dict[str, object] | None = None,
               state: bool = False) -> LocalAgent:
    """An agent on node `i` of `net`, its peers the network's other nodes. Its peer reads
    time out after `timeout`: by default long, so that a loaded machine never turns a read
    the test expects into a timeout. `named`: its node name is `node<i>` (what hand-off
    hints name; otherwise the host's name, the same for every namespace). `lru`: DRAM
    evicts the least recently used chunk first (not the default's S3-FIFO, which keeps
    chunks that were read). `shared_tier`: its `tiers.shared` section as given (an S3
    store, say), in place of `shared`'s directory. `state`: a state directory
    (`stateDir`), `state` in `workdir`."""
    node = net.nodes[i]
    workdir.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, object] = {
        "peers": {
            "enabled": True, "port": PEER_PORT, "address": node.addr, "advertise": node.addr,
            "secretFile": str(secret), "timeout": timeout,
            "addresses": [f"{n.addr}:{PEER_PORT}" for n in net.nodes if n is not node],
            **(extra or {}),
        },
        "tiers": {},
    }
    tiers: dict[str, object] = {}
    if nvme:
        tiers["nvme"] = {"path": str(workdir / "nvme"), "size": "256Mi"}
    if shared is not None:
        tiers["shared"] = {"url": f"file://{shared}"}
    if shared_tier is not None:
        tiers["shared"] = shared_tier
    cfg["tiers"] = tiers
    if events is not None:
        cfg["events"] = events
    if named:
        cfg["nodeName"] = f"node{i}"
    if state:
        cfg["stateDir"] = str(workdir / "state")
    policy: dict[str, object] = {}
    if not prefetch:  # a LOOKUP loads nothing ahead: only the test's reads read
        policy["prefetch"] = {"enabled": False}
    if lru:
        policy["tiers"] = {"dram": {"eviction": "lru"}}
    if policy:
        cfg["policy"] = policy
    if tenants:
        cfg["tenants"] = [{"name": t} for t in tenants]
    path = workdir / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return LocalAgent("--no-lock", "--config", str(path), workdir=workdir, dram=dram, arena=arena,
                      prefix=["ip", "netns", "exec", node.ns], metrics_host=node.addr)


def in_ns(node: Node, *cmd: str) -> str:
    return subprocess.run(["ip", "netns", "exec", node.ns, *cmd], check=True,
                          capture_output=True, text=True).stdout


def usable() -> str | None:
    """Why this process cannot make network namespaces, or None when it can."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "the ip program (iproute2) is missing"
    return None
