"""The agent's own time per request of a put and a read, and the client's per chunk.

    python benchmarks/put_ops.py                      # 256 chunks of 1 MiB bytes, 7 rounds
    python benchmarks/put_ops.py --tensor             # the same as CPU tensors (WSUM kind)
    python benchmarks/put_ops.py --py-spy agent.txt   # the agent under py-spy (collapsed)

Each round deletes the last round's keys, `put_many`s fresh ones (ALLOC and COMMIT a window
at a time) and reads them back with `get_many_into` (ACQUIRE, RELEASE); the first round
warms up. Prints one JSON line: the client's median µs a chunk of a put and a read, and the
agent's mean µs per request of each op over the measured rounds, from its own
`kvpool_op_duration_seconds` histogram (the handling of a request, from its decoding to its
reply queued: not the event loop's turns, nor the socket's share), and the agent process's
CPU time per chunk of a put and of a read (all of it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

MiB = 1 << 20
OPS = ("alloc", "commit", "acquire", "release", "delete")


def op_seconds(url: str) -> dict[str, tuple[float, float]]:
    """(sum of seconds, count) of each op's requests so far, from the agent's metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "kvpool_op_duration_seconds":
            continue
        for s in family.samples:
            op = s.labels.get("op", "")
            if op not in OPS:
                continue
            row = out.setdefault(op, [0.0, 0.0])
            if s.name.endswith("_sum"):
                row[0] = s.value
            elif s.name.endswith("_count"):
                row[1] = s.value
    return {op: (v[0], v[1]) for op, v in out.items()}


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user and system, all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=int, default=MiB, help="chunk bytes")
    ap.add_argument("--chunks", type=int, default=256, help="chunks a round")
    ap.add_argument("--reps", type=int, default=7, help="measured rounds")
    ap.add_argument("--tensor", action="store_true", help="CPU tensors (WSUM), not bytes")
    ap.add_argument("--py-spy", default="", metavar="FILE",
                    help="run the agent under `py-spy record` (collapsed stacks to FILE)")
    a = ap.parse_args()
    if a.tensor:
        import torch

        data: list[Any] = [torch.randint(0, 256, (a.chunk,), dtype=torch.uint8)
                           for _ in range(a.chunks)]
        out: list[Any] = [torch.empty_like(t) for t in data]
    else:
        data = [os.urandom(a.chunk) for _ in range(a.chunks)]
        out = [bytearray(a.chunk) for _ in range(a.chunks)]
    # Four rounds' bytes: two windows of a put fit the quarter of the arena in which the
    # next window's ALLOCs go out before this window's COMMITs (putwindows.AHEAD_SHARE).
    dram = f"{max(64, 4 * a.chunks * a.chunk // MiB)}Mi"
    puts: list[float] = []
    gets: list[float] = []
    spy: subprocess.Popen[bytes] | None = None
    with LocalAgent("--no-lock", "--max-chunk", "64Mi", dram=dram,
                    start_timeout=120) as agent, KVPoolClient(agent.socket_path) as kv:
        keys: list[bytes] = []
        assert agent.proc is not None
        pid = agent.proc.pid
        put_cpu = get_cpu = 0.0
        before = op_seconds(agent.metrics_url)
        for rep in range(a.reps + 1):
            for k in keys:
                kv.delete(k)
            keys = [os.urandom(16) for _ in range(a.chunks)]
            c0 = cpu_seconds(pid)
            t0 = time.perf_counter()
            assert all(r is True for r in kv.put_many(keys, data))
            t1 = time.perf_counter()
            c1 = cpu_seconds(pid)
            assert all(kv.get_many_into(keys, lambda i, n, m: out[i]))
            t2 = time.perf_counter()
            c2 = cpu_seconds(pid)
            if rep == 0:
                before = op_seconds(agent.metrics_url)
                if a.py_spy:  # the measured rounds only
                    assert agent.proc is not None
                    spy = subprocess.Popen(["py-spy", "record", "--pid", str(agent.proc.pid),
                                            "--format", "raw", "--rate", "1000",
                                            "-o", a.py_spy], stdout=subprocess.DEVNULL)
                    time.sleep(1)  # attached
            else:
                puts.append(t1 - t0)
                gets.append(t2 - t1)
                put_cpu += c1 - c0
                get_cpu += c2 - c1
        after = op_seconds(agent.metrics_url)
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt
            spy.wait(timeout=60)
    agent_us = {}
    for op in OPS:
        s0, n0 = before.get(op, (0.0, 0.0))
        s1, n1 = after.get(op, (0.0, 0.0))
        if n1 > n0:
            agent_us[op] = round((s1 - s0) / (n1 - n0) * 1e6, 2)
    load = os.getloadavg()
    print(json.dumps({
        "chunk": a.chunk, "chunks": a.chunks, "reps": a.reps, "tensor": a.tensor,
        "put_us_per_chunk": round(sorted(puts)[len(puts) // 2] / a.chunks * 1e6, 1),
        "get_us_per_chunk": round(sorted(gets)[len(gets) // 2] / a.chunks * 1e6, 1),
        "agent_us_per_request": agent_us,
        # The agent process's CPU time (every thread, the event loop's turns and system
        # calls included), per chunk; at the clock tick's resolution (10 ms a call).
        "agent_cpu_us_per_chunk": {
            "put": round(put_cpu / (a.reps * a.chunks) * 1e6, 1),
            "get": round(get_cpu / (a.reps * a.chunks) * 1e6, 1)},
        "loadavg": [round(x, 2) for x in load],
    }))


if __name__ == "__main__":
    main()
