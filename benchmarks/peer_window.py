"""Peer reads in one window, timed from the inside: the peer part's two agents on two network
namespaces (`kvpool.bench.peer_tier`: `Network`, `peer_agent`, `peer_reads`, `raw_tcp_cpu`;
root and iproute2), rounds of one `get_many_into` window of 64 chunks of 1 MiB and 16 of
16 MiB, each against raw TCP over the same links in the same run.

Per size: the window's GB/s (median of the rounds) and its ratio to raw TCP; when the
client starts copying each chunk (its reply in), from the round's start (its LOOKUP):
the first chunk's and the last one's, medians with the 10th-90th percentile; each
process's CPU (user + system) per GB and per round, its minor page faults and context
switches per round; each thread's share of the rounds' wall time it was busy (`c` the
client, this process; `r` the reading agent; `h` the holder; `*` a process's main
thread), the busiest first; the reading agent's threads but its event loop (those that
receive FETCH replies) in CPU s/GB against the raw receiver's thread; its event loop (its
main thread) alone as a busy share, CPU s/GB and µs a chunk (`reader_loop_*`). A thread's
CPU is the scheduler's nanoseconds where /proc has them (`schedstat`), else clock ticks.
Only the timed rounds count (not the warm-up round, the puts, the checks or the deletes
between rounds).
`--connections N` sets both agents' `peers.connections`. Raw TCP twice, taking turns: sent
by `sendall` (the bench's baseline, `raw_tcp_gbps`, `vs_raw`) and by `sendfile` from a
shared-memory file as the holder sends (`raw_sendfile_gbps`, `vs_raw_sendfile`; the
receiver's CPU per GB beside each; `--no-sendfile` leaves it out).

`--tree DIR` (repeatable) runs the agents from another checkout's sources (its `agent/`
and `operator/` on their PYTHONPATH; the client is always this process's): the trees take
turns, `--pairs` times, each turn on two fresh agents, so that one run compares a change
with the tree before it at the same load. One JSON line on stdout; `--out FILE` keeps it.

    sudo flock /tmp/kvpool-bench.lock env PYTHONPATH=agent:operator \\
        python benchmarks/peer_window.py                 # ~30 s on 2 cores
    ... python benchmarks/peer_window.py --tree /path/to/before --tree . --pairs 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from kvpool.bench.netns import PEER_PORT, Network, peer_agent
from kvpool.bench.peer_tier import (
    CONGESTION_CONTROL,
    clients,
    congestion_control,
    peer_reads,
    raw_sender,
    raw_tcp_cpu,
)
from kvpool.bench.stats import MiB, percentile
from kvpool.bench.trees import agents_from, commit_of

SIZES = {1: 64, 16: 16}
"""Chunk MiB: chunks a window (as `kvpool bench --part peer`)."""


def _faults(pid: int) -> int:
    """Minor page faults of the process so far (/proc/PID/stat, field 10)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _thread_cpu(pid: int, tid: int, ticks: float) -> float:
    """A thread's CPU seconds so far: the scheduler's nanoseconds (/proc/PID/task/TID/
    schedstat, its first field) where the kernel keeps them, else `ticks` (psutil's user +
    system time, in clock ticks of 10 ms: a thread busy 13 ms a round reads 10 or 20)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return ticks


class Watch:
    """`peer_tier.RoundWatch`: per round, when each chunk's copy starts, and the CPU of
    every thread of the three processes over the round."""

    def __init__(self, procs: dict[str, psutil.Process]) -> None:
        self.procs = procs
        self.rounds: list[dict[str, Any]] = []
        self._at: dict[int, float] = {}
        self._t0 = 0.0
        self._threads: dict[tuple[str, int], float] = {}
        self._proc0: dict[str, tuple[float, int, int]] = {}

    def _snap(self) -> tuple[dict[tuple[str, int], float], dict[str, tuple[float, int, int]]]:
        threads: dict[tuple[str, int], float] = {}
        procs: dict[str, tuple[float, int, int]] = {}
        for tag, p in self.procs.items():
            for t in p.threads():
                threads[(tag, t.id)] = _thread_cpu(p.pid, t.id, t.user_time + t.system_time)
            c, ctx = p.cpu_times(), p.num_ctx_switches()
            procs[tag] = (c.user + c.system, _faults(p.pid), ctx.voluntary + ctx.involuntary)
        return threads, procs

    def begin(self) -> None:
        self._threads, self._proc0 = self._snap()
        self._at = {}
        self._t0 = time.perf_counter()  # the round's clock starts right after this

    def copy(self, i: int) -> None:
        self._at.setdefault(i, time.perf_counter() - self._t0)

    def end(self) -> None:
        wall = time.perf_counter() - self._t0
        threads, procs = self._snap()
        self.rounds.append({
            "wall": wall, "copies": [self._at.get(i) for i in range(len(self._at))],
            "threads": {k: v - self._threads.get(k, 0.0) for k, v in threads.items()},
            "procs": {tag: tuple(a - b for a, b in zip(v, self._proc0[tag], strict=True))
                      for tag, v in procs.items()}})


def _ms(xs: list[float]) -> dict[str, float]:
    return {"p50": round(percentile(xs, 50) * 1e3, 2), "p10": round(percentile(xs, 10) * 1e3, 2),
            "p90": round(percentile(xs, 90) * 1e3, 2)}


def _per_gb(raw_cpu: list[tuple[float, float]], total: int) -> float:
    """The raw receiver's CPU seconds per GB over its transfers."""
    return round(sum(c for _, c in raw_cpu) / (total * len(raw_cpu) / 1e9), 3)


def _summary(watch: Watch, times: list[float], raw_cpu: list[tuple[float, float]],
             by_file: list[tuple[float, float]], size: int, count: int) -> dict[str, Any]:
    rounds = watch.rounds[1:]  # the first is the warm-up round
    total = size * count
    raw = [t for t, _ in raw_cpu]
    gbps, raw_gbps = total / percentile(times, 50) / 1e9, total / percentile(raw, 50) / 1e9
    wall = sum(r["wall"] for r in rounds)
    gb = total * len(rounds) / 1e9
    procs: dict[str, Any] = {}
    for tag in watch.procs:
        cpu, faults, ctx = (sum(r["procs"][tag][j] for r in rounds) for j in range(3))
        procs[tag] = {"cpu_s_per_gb": round(cpu / gb, 3), "busy": round(cpu / wall, 2),
                      "minor_faults_per_round": round(faults / len(rounds)),
                      "ctx_switches_per_round": round(ctx / len(rounds))}
    busy: dict[tuple[str, int], float] = {}
    for r in rounds:
        for k, v in r["threads"].items():
            busy[k] = busy.get(k, 0.0) + v
    # The reading agent's threads but its event loop: mostly those receiving FETCH replies,
    # against the raw receiver's one thread (what a byte costs each to take in).
    workers = sum(v for (tag, tid), v in busy.items()
                  if tag == "r" and tid != watch.procs["r"].pid)
    # The reading agent's event loop (its main thread): the busiest thread at 1 MiB chunks.
    loop = busy.get(("r", watch.procs["r"].pid), 0.0)
    threads = []
    for (tag, tid), cpu in sorted(busy.items(), key=lambda kv: -kv[1])[:10]:
        main = tid == watch.procs[tag].pid
        threads.append([f"{tag}{'*' if main else ''}:{tid}", round(cpu / wall, 2)])
    copies = [r["copies"] for r in rounds if r["copies"] and None not in r["copies"]]
    out: dict[str, Any] = {
        "chunks": count, "rounds": len(rounds), "window_gbps": round(gbps, 3),
        "raw_tcp_gbps": round(raw_gbps, 3), "vs_raw": round(gbps / raw_gbps, 3),
        "round_ms": _ms(times), "raw_ms": _ms(raw), "process": procs, "threads": threads,
        "reader_workers_cpu_s_per_gb": round(workers / gb, 3),
        "reader_loop_busy": round(loop / wall, 3),
        "reader_loop_cpu_s_per_gb": round(loop / gb, 3),
        "reader_loop_us_per_chunk": round(loop / (count * len(rounds)) * 1e6, 1),
        "raw_receiver_cpu_s_per_gb": _per_gb(raw_cpu, total)}
    if by_file:
        file_gbps = total / percentile([t for t, _ in by_file], 50) / 1e9
        out |= {"raw_sendfile_gbps": round(file_gbps, 3),
                "vs_raw_sendfile": round(gbps / file_gbps, 3),
                "raw_sendfile_receiver_cpu_s_per_gb": _per_gb(by_file, total)}
    if copies:
        out["first_copy_ms"] = _ms([c[0] for c in copies])
        out["last_copy_ms"] = _ms([c[-1] for c in copies])
        # The copy starts of a median round, every eighth chunk: how evenly they follow.
        step = max(1, count // 8)
        out["copy_start_ms"] = [round(percentile([c[i] for c in copies], 50) * 1e3, 2)
                                for i in range(0, count, step)] + [
            round(percentile([c[-1] for c in copies], 50) * 1e3, 2)]
    return out


def one_turn(net: Network, tmp: Path, secret: Path, tree: Path | None, raw_at: tuple[str, int],
             rounds: dict[int, int], raw_reps: int, sizes: list[int],
             peers: dict[str, Any], sendfile: bool) -> dict[str, Any]:
    dram = max(s * MiB * SIZES[s] for s in sizes) * 2 + 16 * MiB
    out: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        with agents_from(tree):
            agents = [stack.enter_context(peer_agent(
                net, i, tmp / f"node{i}", secret, nvme=False, dram=str(dram), prefetch=False,
                named=True, extra={"addresses": [f"{net.nodes[1 - i].addr}:{PEER_PORT}"],
                                   **peers}))
                for i in range(2)]
        holder, reader = clients(stack, agents)
        procs = {"c": psutil.Process(),
                 "r": psutil.Process(agents[1].proc.pid),  # type: ignore[union-attr]
                 "h": psutil.Process(agents[0].proc.pid)}  # type: ignore[union-attr]
        for s in sizes:
            size, count = s * MiB, SIZES[s]
            raw, by_file = [], []
            for _ in range(raw_reps):  # the two ways taking turns
                raw.append(raw_tcp_cpu(raw_at, net.nodes[1], size, count))
                if sendfile:
                    by_file.append(raw_tcp_cpu(raw_at, net.nodes[1], size, count, True))
            watch = Watch(procs)
            times, verified = peer_reads(holder, reader, size, count, rounds[s], many=True,
                                         watch=watch)
            out[f"{s}MiB"] = {**_summary(watch, times, raw, by_file, size, count),
                              "bytes_verified": verified}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", type=Path, default=[],
                    help="run the agents from this checkout (repeatable: the trees take turns)")
    ap.add_argument("--pairs", type=int, default=1, help="turns of each tree (default 1)")
    ap.add_argument("--rounds", type=int, default=15, help="timed 1 MiB windows a turn")
    ap.add_argument("--large-rounds", type=int, default=8, help="timed 16 MiB windows a turn")
    ap.add_argument("--raw-reps", type=int, default=5, help="raw TCP transfers a size a turn")
    ap.add_argument("--sizes", default="1,16", help="chunk MiB to read: 1, 16 or both")
    ap.add_argument("--no-sendfile", action="store_true",
                    help="leave out raw TCP sent by sendfile from a shared-memory file")
    ap.add_argument("--connections", type=int,
                    help="both agents' peers.connections (default: the agents' own)")
    ap.add_argument("--out", type=Path, help="also write the JSON line here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if set(sizes) - set(SIZES):
        ap.error(f"--sizes: of {sorted(SIZES)}")
    trees: list[Path | None] = [t.resolve() for t in args.tree] or [None]
    here = Path(__file__).resolve().parent.parent
    started = time.monotonic()
    load0 = os.getloadavg()[0]
    turns: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvpool-peer-window-") as tmpdir, \
            Network(2) as net, contextlib.ExitStack() as stack:
        cc = congestion_control(net, CONGESTION_CONTROL)
        tmp = Path(tmpdir)
        secret = tmp / "secret"
        secret.write_bytes(os.urandom(32).hex().encode())
        raw_at = raw_sender(net.nodes[0], stack)
        for pair in range(args.pairs):
            for n, tree in enumerate(trees):
                load = os.getloadavg()[0]
                sub = tmp / f"turn{pair}-{n}"
                got = one_turn(net, sub, secret, tree, raw_at,
                               {1: args.rounds, 16: args.large_rounds}, args.raw_reps, sizes,
                               {} if args.connections is None
                               else {"connections": args.connections},
                               not args.no_sendfile)
                turns.append({"tree": str(tree or here), "pair": pair,
                              "load": [round(load, 2), round(os.getloadavg()[0], 2)], **got})
    summary: dict[str, Any] = {}
    for tree in trees:
        name = str(tree or here)
        mine = [t for t in turns if t["tree"] == name]
        summary[name] = {
            f"{s}MiB": {k: round(percentile([t[f"{s}MiB"][k] for t in mine], 50), 3)
                        for k in ("vs_raw", "window_gbps", "raw_tcp_gbps", "vs_raw_sendfile",
                                  "raw_sendfile_gbps", "reader_workers_cpu_s_per_gb",
                                  "reader_loop_busy", "reader_loop_cpu_s_per_gb",
                                  "reader_loop_us_per_chunk",
                                  "raw_receiver_cpu_s_per_gb",
                                  "raw_sendfile_receiver_cpu_s_per_gb")
                        if k in mine[0][f"{s}MiB"]}
            | {"first_copy_ms": round(percentile(
                [t[f"{s}MiB"]["first_copy_ms"]["p50"] for t in mine], 50), 2)}
            for s in sizes}
    line = json.dumps({
        "meta": {"cores": len(os.sched_getaffinity(0)), "kernel": platform.release(),
                 "congestion_control": cc, "load_average": [round(load0, 2),
                                                           round(os.getloadavg()[0], 2)],
                 "seconds": round(time.monotonic() - started, 1),
                 "commits": {str(t or here): commit_of(t or here) for t in trees}},
        "summary": summary, "turns": turns})
    print(line, flush=True)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
