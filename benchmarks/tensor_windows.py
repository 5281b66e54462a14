"""The client's cost per chunk and per piece on the tensor path, through a real agent.

    python benchmarks/tensor_windows.py --device cpu    # CPU tensors: the client's own cost
    python benchmarks/tensor_windows.py --device cuda   # a GPU: batched, then one copy_ a piece

Two shapes, each put (`put_many`, WSUM on) and got back (`get_many_into`, not verified):
- `kv`: chunks of 64 segments (K and V of 32 layers, as `kvpool bench --gpu`'s time to
  first token loads them), `--segment` bytes each (default 512 KiB on a GPU, 8 KiB on the
  CPU, where the bytes would hide the client's cost);
- `flat`: chunks of one tensor of `--chunk` bytes (default 1 MiB).
Prints one JSON line: per shape and direction the median seconds of a call, GB/s, µs a
chunk and µs a piece (segment), and how the windows were copied (`cudacopy.report`). On a
GPU the same again with the batch call turned off (one `copy_` a piece), for comparison.
`--profile`: then one more put and get of each shape under cProfile, the functions that
took the longest (cumulative) printed to stderr: where a chunk's time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from typing import Any

import torch

from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

try:
    from kvpool.agent import cudacopy
except ImportError:  # a checkout from before the batched copies (for a baseline)
    cudacopy = None  # type: ignore[assignment]

KiB, MiB = 1 << 10, 1 << 20


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def measure(kv: KVPoolClient, chunks: list[list[torch.Tensor]], device: str,
            reps: int) -> dict[str, Any]:
    stream: Any = torch.cuda.Stream() if device == "cuda" else None
    pieces = sum(len(c) for c in chunks)
    nbytes = sum(s.nbytes for c in chunks for s in c)
    out = [[torch.empty_like(s) for s in c] for c in chunks]
    puts, gets = [], []
    keys: list[bytes] = []
    for rep in range(reps + 1):  # the first warms up
        for k in keys:
            kv.delete(k)
        keys = [os.urandom(16) for _ in chunks]
        _sync(device)
        t0 = time.perf_counter()
        assert all(r is True for r in kv.put_many(keys, chunks, stream=stream))
        t1 = time.perf_counter()
        assert all(kv.get_many_into(keys, lambda i, n, m: out[i], stream=stream))
        _sync(device)
        t2 = time.perf_counter()
        if rep:
            puts.append(t1 - t0)
            gets.append(t2 - t1)
    for k in keys:
        kv.delete(k)
    exact = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # (NaNs: bytes)
                for c, o in zip(chunks, out, strict=True) for a, b in zip(c, o, strict=True))
    row: dict[str, Any] = {"chunks": len(chunks), "pieces": pieces, "bytes": nbytes,
                           "byte_exact": exact}
    for name, t in (("put", _median(puts)), ("get", _median(gets))):
        row[name] = {"s": round(t, 5), "gbps": round(nbytes / t / 1e9, 2),
                     "us_per_chunk": round(t / len(chunks) * 1e6, 1),
                     "us_per_piece": round(t / pieces * 1e6, 2)}
    return row


def shapes(device: str, segment: int, chunk: int, total: int) -> dict[str, Any]:
    def rand(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    kv_chunks = max(1, total // (64 * segment))
    flat_chunks = max(1, total // chunk)
    return {"kv": [[rand(segment).view(torch.bfloat16) for _ in range(64)]
                   for _ in range(kv_chunks)],
            "flat": [[rand(chunk)] for _ in range(flat_chunks)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--segment", type=int, default=0, help="kv segment bytes")
    ap.add_argument("--chunk", type=int, default=MiB, help="flat chunk bytes")
    ap.add_argument("--total", type=int, default=0, help="bytes a call (per shape)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="profile a put and a get a shape")
    a = ap.parse_args()
    gpu = a.device == "cuda"
    segment = a.segment or (512 * KiB if gpu else 8 * KiB)
    total = a.total or (1 << 30 if gpu else 32 * MiB)
    data = shapes(a.device, segment, a.chunk, total)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if gpu else "cpu",
                              "segment": segment, "chunk": a.chunk}
    dram = f"{max(1, 3 * total // (1 << 30) + 1)}Gi"
    with LocalAgent("--no-lock", "--max-chunk", "64Mi", dram=dram, start_timeout=120) as agent, \
            KVPoolClient(agent.socket_path) as kv:
        runs = ["batched", "per_piece"] if gpu else ["host"]
        for run in runs:
            if run == "per_piece" and cudacopy is not None:
                cudacopy.loaded.disable("turned off for the comparison")
            result[run] = {name: measure(kv, chunks, a.device, a.reps)
                           for name, chunks in data.items()}
            result[run]["copies"] = cudacopy.report() if cudacopy is not None else None
            if a.profile:
                for name, chunks in data.items():
                    profiler = cProfile.Profile()
                    profiler.enable()
                    measure(kv, chunks, a.device, 1)
                    profiler.disable()
                    print(f"--- {run}, {name}: one put and one get, after a warm-up",
                          file=sys.stderr)
                    pstats.Stats(profiler, stream=sys.stderr).sort_stats(
                        "cumulative").print_stats(30)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
