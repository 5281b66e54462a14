"""Helpers the benchmark parts share: timing, percentiles, summaries, baseline servers."""

from __future__ import annotations

import contextlib
import math
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

KiB = 1024
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Summary:
    """Median of repeated measurements with their spread (min and max)."""

    median: float
    low: float
    high: float
    n: int

    def fields(self, name: str, digits: int = 4) -> dict[str, float]:
        """`name` (the median), `name_min`, `name_max` for the result JSON."""
        return {name: round(self.median, digits), f"{name}_min": round(self.low, digits),
                f"{name}_max": round(self.high, digits)}


def summarize(values: Sequence[float]) -> Summary:
    if not values:
        raise ValueError("nothing to summarize")
    return Summary(statistics.median(values), min(values), max(values), len(values))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank on the sorted values."""
    if not values:
        raise ValueError("no values")
    s = sorted(values)
    rank = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[rank]


def timed(ops: dict[str, Callable[[int], object]], reps: int, warmup: int = 1,
          after: Callable[[int], object] | None = None) -> dict[str, list[float]]:
    """Seconds of `reps` calls of each op(i), the ops taking turns, after `warmup` rounds.

    Round i calls every op once, in order, each timed on its own; `after(i)`,
    when given, runs untimed after each round (warm-up ones too): the clean-up
    a round needs so the next one measures the same thing. Taking turns puts
    a figure and its baseline in the same moments, so on a shared machine a
    burst of load from elsewhere moves both instead of the ratio between them.
    """
    out: dict[str, list[float]] = {name: [] for name in ops}
    for i in range(warmup + reps):
        for name, fn in ops.items():
            t0 = time.perf_counter()
            fn(i)
            dt = time.perf_counter() - t0
            if i >= warmup:
                out[name].append(dt)
        if after is not None:
            after(i)
    return out


def gbps(nbytes: int, seconds: Sequence[float]) -> Summary:
    """Throughput in GB/s (10^9 bytes per second) for each timing."""
    return summarize([nbytes / s / 1e9 for s in seconds if s > 0])


def throughput(nbytes: int, timings: dict[str, list[float]]) -> dict[str, float]:
    """`name`, `name_min`, `name_max` in GB/s for each named list of timings."""
    out: dict[str, float] = {}
    for name, seconds in timings.items():
        out.update(gbps(nbytes, seconds).fields(name))
    return out


@contextlib.contextmanager
def child_server(argv: list[str], ready: Callable[[], bool], what: str,
                 timeout: float = 15.0) -> Iterator[subprocess.Popen[bytes]]:
    """A baseline server (redis-server, moto) as a child process, up once `ready()`.

    Stopped on exit: SIGTERM, then SIGKILL if it has not gone in 10 s.
    """
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} was not ready in {timeout:.0f}s")
            time.sleep(0.02)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB}MiB" if nbytes >= MiB else f"{nbytes // 1024}KiB"
