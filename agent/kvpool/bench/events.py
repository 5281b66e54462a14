"""KV-events part of `kvpool bench`: what publishing events costs a put.

Two agents in one run, the same but for `events.enabled`; the one with events
publishes in `node` topic mode to a subscriber that receives every message (a
process of its own that does not decode: a router decodes on its own machine). Each round
puts a window of new chunks (`window`) with `put_many` into each agent, the two taking
turns (`bench_stats.timed`), and deletes them untimed after the round. The
figure is the ratio of put throughput with events to without (1.0: free);
the issue's target is a cost under 5 % (a ratio above 0.95). Small chunks
are the worst case: the cost is per chunk, not per byte.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpool.agent.client import KVPoolClient

from . import demo
from .data_path import payload
from .local import LocalAgent, free_port
from .stats import child_server, size_label, throughput, timed


def window(nbytes: int) -> int:
    """Chunks one timed put_many stores: 64 small ones, fewer large ones (32 MiB, at least
    4 chunks), so both agents' arenas stay small."""
    return max(4, min(64, (32 << 20) // nbytes))


_RECEIVER = """
import sys, zmq
sub = zmq.Context().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
while True:
    sub.recv_multipart()
"""


def _subscriber(endpoint: str) -> contextlib.AbstractContextManager[object]:
    """A subscriber receiving everything published at `endpoint` (in a process of its own,
    not decoding: a router's decoding runs on its own machine, not the agent's)."""
    return child_server([sys.executable, "-c", _RECEIVER, endpoint], lambda: True,
                        "the events subscriber")


def _round(nbytes: int, c_off: KVPoolClient, c_on: KVPoolClient
           ) -> tuple[dict[str, Callable[[int], object]], Callable[[int], object]]:
    """The two timed puts of a round (events off, on) and the untimed clean-up after it."""
    n = window(nbytes)
    chunks = [payload(nbytes)] * n

    def keys(i: int, salt: bytes) -> list[bytes]:
        return [salt + i.to_bytes(4, "little") + j.to_bytes(4, "little") + bytes(8 - len(salt))
                for j in range(n)]

    def put(client: KVPoolClient, salt: bytes) -> Callable[[int], object]:
        def call(i: int) -> None:
            if not all(r is True for r in client.put_many(keys(i, salt), chunks)):
                raise RuntimeError("events bench: a put was refused")
        return call

    def clean(i: int) -> None:
        for k in keys(i, b"off"):
            c_off.delete(k)
        for k in keys(i, b"on"):
            c_on.delete(k)

    return {"off": put(c_off, b"off"), "on": put(c_on, b"on")}, clean


def run_events(sizes: list[int], reps: int) -> dict[str, Any]:
    """Per chunk size: put throughput with events off and on, and their ratio."""
    out: dict[str, Any] = {}
    dram = str(max(n * window(n) for n in sizes) * 2 + (64 << 20))
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-events-") as tmp:
        port, replay = free_port(), free_port()
        cfg = Path(tmp) / "events.yaml"
        cfg.write_text(f"events: {{enabled: true, address: 127.0.0.1, port: {port}, "
                       f"replayPort: {replay}, topic: node}}\n")
        with LocalAgent("--no-lock", dram=dram, start_timeout=60) as off, \
                LocalAgent("--no-lock", "--config", str(cfg), dram=dram,
                           start_timeout=60) as on, \
                _subscriber(f"tcp://127.0.0.1:{port}"), \
                KVPoolClient(off.socket_path) as c_off, \
                KVPoolClient(on.socket_path) as c_on:
            for nbytes in sizes:
                ops, clean = _round(nbytes, c_off, c_on)
                t = timed(ops, reps, warmup=2, after=clean)
                row = throughput(nbytes * window(nbytes), {"put_gbps_events_off": t["off"],
                                                   "put_gbps_events_on": t["on"]})
                row["events_on_vs_off"] = round(
                    row["put_gbps_events_on"] / row["put_gbps_events_off"], 3)
                out[size_label(nbytes)] = row
            published = demo.published(on)
    return {"sizes": out, "events_published": published}
