"""Peer reads over a link slower than a batch: the peer part's two agents on two network
namespaces (`kvpool.bench.netns`; root and iproute2), the holder's link throttled by `tc`
(a token bucket, `--rate`), and windows of 32 chunks of 1 MiB, each its own prompt (a
LOOKUP of its own), read by a lease-free client on the other node as the vLLM connector
reads them, one after the other.

Per window: the chunks that came from the peer (with their bytes: every read is compared),
the reads that timed out (`kvpool_peer_requests_total{result="timeout"}`), what STATS says
of the peer after it (`ok`, or `slow`: not read from for 5 s), and the window's MB/s against
raw TCP between the same namespaces through the same throttle in the same run (32 MiB).
A window's chunks the peer did not give are misses here (no shared tier).

`--busy N` runs N processes that spin on a core beside the agents for the whole run, as a
CI machine's test workers load it: on a slow link the margin a batch's size leaves within
the timeout is what the agents' scheduling eats.

`--tree DIR` (repeatable) runs the agents from another checkout's sources (as
`peer_window.py` does), each tree a turn on fresh agents, so that one run compares a change
with the tree before it. One JSON line on stdout; `--out FILE` keeps it.

    sudo env PYTHONPATH=agent:operator python benchmarks/slow_link.py     # ~30 s
    ... python benchmarks/slow_link.py --tree /path/to/before --tree .
    ... python benchmarks/slow_link.py --tree /path/to/before --tree . --busy 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent
from kvpool.bench.netns import PEER_PORT, Network, in_ns, peer_agent
from kvpool.bench.peer_tier import clients, raw_sender, raw_tcp
from kvpool.bench.stats import MiB, percentile
from kvpool.bench.trees import agents_from, commit_of

CHUNKS = 32
"""Chunks of 1 MiB a window: one batch's worth before batches are sized to the link."""


def timeouts(agent: LocalAgent) -> float:
    """The agent's peer reads that timed out so far."""
    with urllib.request.urlopen(f"{agent.metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("kvpool_peer_requests_total{")
               and 'direction="read"' in line and 'result="timeout"' in line)


def peer_state(reader: KVPoolClient, addr: str) -> str:
    """What STATS says of the peer at `addr` (`ok`, `slow`, ...; `?` from an agent whose
    STATS does not list its peers)."""
    for peer in reader.stats().get("peers", []):
        if peer["peer"] == f"{addr}:{PEER_PORT}":
            return str(peer["state"])
    return "?"


def one_turn(net: Network, tmp: Path, secret: Path, tree: Path | None, rate: str,
             timeout: str, windows: int, raw_at: tuple[str, int]) -> dict[str, Any]:
    holder_node, reader_node = net.nodes
    out: dict[str, Any] = {"windows": []}
    with contextlib.ExitStack() as stack:
        with agents_from(tree):
            agents = [stack.enter_context(peer_agent(
                net, i, tmp / f"node{i}", secret, nvme=False, timeout=timeout,
                dram=f"{(windows * CHUNKS + 64)}Mi", prefetch=False, named=True,
                extra={"addresses": [f"{net.nodes[1 - i].addr}:{PEER_PORT}"]}))
                for i in range(2)]
        holder, reader = clients(stack, agents)
        prompts = [[os.urandom(16) for _ in range(CHUNKS)] for _ in range(windows)]
        data = {k: os.urandom(MiB) for keys in prompts for k in keys}
        for keys in prompts:
            holder.put_many(keys, [data[k] for k in keys])
        for keys in prompts:  # a LOOKUP each: a window's reads do not run on into the next
            deadline = time.monotonic() + 60
            while reader.lookup_tiers(keys) != ["peer"] * CHUNKS:
                if time.monotonic() > deadline:
                    raise RuntimeError("slow link bench: the chunks never reached the directory")
                time.sleep(0.05)
        in_ns(holder_node, "tc", "qdisc", "add", "dev", holder_node.inner, "root", "tbf",
              "rate", rate, "burst", "256kb", "latency", "400ms")
        stack.callback(in_ns, holder_node, "tc", "qdisc", "del", "dev", holder_node.inner,
                       "root")
        raw = [raw_tcp(raw_at, reader_node, MiB, CHUNKS) for _ in range(2)]
        out["raw_mbps"] = round(CHUNKS * MiB / percentile(raw, 50) / 1e6, 1)
        for keys in prompts:
            bufs = [bytearray(MiB) for _ in keys]
            before = timeouts(agents[1])
            start = time.perf_counter()
            found = reader.lookup_tiers(keys)  # as an engine asks before it reads
            got = reader.get_many_into(keys, lambda i, n, meta, bufs=bufs: bufs[i])
            seconds = time.perf_counter() - start
            read = [n == MiB and bytes(b) == data[k] for n, b, k in zip(got, bufs, keys,
                                                                          strict=True)]
            if any(n and not ok for n, ok in zip(got, read, strict=True)):
                raise RuntimeError("slow link bench: a chunk read from the peer differs")
            out["windows"].append({
                "found_in_peer": found.count("peer"), "from_peer": sum(read),
                "timeouts": int(timeouts(agents[1]) - before),
                "peer_after": peer_state(reader, holder_node.addr),
                "seconds": round(seconds, 3),
                "mbps": round(sum(read) * MiB / seconds / 1e6, 1)})
    later = out["windows"][1:]  # after the first, which meets the link unmeasured
    out["chunks_from_peer"] = sum(w["from_peer"] for w in out["windows"])
    out["of"] = windows * CHUNKS
    out["timeouts"] = sum(w["timeouts"] for w in out["windows"])
    if later:
        mbps = percentile([w["mbps"] for w in later], 50)
        out["later_windows_mbps"] = round(mbps, 1)
        out["later_windows_vs_raw"] = round(mbps / out["raw_mbps"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", type=Path, default=[],
                    help="run the agents from this checkout (repeatable: the trees take turns)")
    ap.add_argument("--rate", default="200mbit", help="the holder's link (tc tbf rate)")
    ap.add_argument("--timeout", default="1s", help="both agents' peers.timeout")
    ap.add_argument("--windows", type=int, default=6, help="windows of 32 MiB a turn")
    ap.add_argument("--busy", type=int, default=0,
                    help="processes spinning on a core beside the agents (a loaded machine)")
    ap.add_argument("--out", type=Path, help="also write the JSON line here")
    args = ap.parse_args()
    trees: list[Path | None] = list(args.tree) or [None]
    here = Path(__file__).resolve().parent.parent
    started = time.monotonic()
    turns = []
    with tempfile.TemporaryDirectory(prefix="kvpool-slow-link-") as tmpdir, \
            Network(2) as net, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        secret = tmp / "secret"
        secret.write_bytes(os.urandom(32).hex().encode())
        raw_at = raw_sender(net.nodes[0], stack)
        for _ in range(args.busy):
            spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            stack.callback(spin.wait)
            stack.callback(spin.kill)
        for n, tree in enumerate(trees):
            got = one_turn(net, tmp / f"turn{n}", secret, tree, args.rate, args.timeout,
                           args.windows, raw_at)
            # (the tree as given, not resolved: a result names no machine's paths)
            turns.append({"tree": str(tree or "."), "commit": commit_of(tree or here), **got})
    line = json.dumps({
        "meta": {"cores": len(os.sched_getaffinity(0)), "kernel": platform.release(),
                 "rate": args.rate, "timeout": args.timeout, "chunks_a_window": CHUNKS,
                 "busy": args.busy,
                 "seconds": round(time.monotonic() - started, 1)},
        "turns": turns})
    print(line, flush=True)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
