"""Small numeric helpers the benchmark parts share: timing, percentiles, summaries."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


def timed(fn: Callable[[int], object], reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `reps` calls fn(i) after `warmup` untimed ones (i counts on)."""
    for i in range(warmup):
        fn(i)
    out: list[float] = []
    for i in range(warmup, warmup + reps):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def gbps(nbytes: int, seconds: Sequence[float]) -> Summary:
    """Throughput in GB/s (10^9 bytes per second) for each timing."""
    return summarize([nbytes / s / 1e9 for s in seconds if s > 0])


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB}MiB" if nbytes >= MiB else f"{nbytes // 1024}KiB"
