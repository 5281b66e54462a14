"""Control-path part of `kvpool bench`: LOOKUP and ACQUIRE/RELEASE latency.

- LOOKUP: `KVPoolClient.lookup` of a 128-chunk prefix that is fully stored
  (the agent walks all 128 keys), one round trip each;
- local LOOKUP: the same with `local_lookup=True`, answered by the client from
  the DRAM index the agent publishes in shared memory (no round trip; the LOOKUP
  is still told to the agent with a later write, its reply not waited for);
- ACQUIRE/RELEASE: `KVPoolClient.get_into` of a 4 KiB chunk, which is an
  ACQUIRE round trip, a 4 KiB copy out of the arena and a RELEASE sent
  without waiting (its reply is read before the next call's): the read path
  an inference engine takes, per chunk.

One client runs in this process; 8 concurrent clients are 8 separate
processes (multiprocessing, spawn), so the GIL of one Python process does
not serialise them: they start together on a barrier and each times its own
calls; percentiles are over all their samples pooled.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

from kvpool.agent.client import KVPoolClient

from .local import LocalAgent
from .stats import percentile

PREFIX_CHUNKS = 128
SMALL_CHUNK = 4096


def _keys(n: int) -> list[bytes]:
    return [b"ctl-bench-key-" + i.to_bytes(2, "little") for i in range(n)]


def sample(socket_path: str, op: str, keys: list[bytes], n: int) -> list[float]:
    """n timed calls of `op` ("lookup", "lookup_local" or "acquire") on one fresh client,
    in seconds."""
    out: list[float] = []
    buf = bytearray(SMALL_CHUNK)
    view = memoryview(buf)
    with KVPoolClient(socket_path, local_lookup=op == "lookup_local") as c:
        for i in range(n + 20):  # 20 warm-up calls
            t0 = time.perf_counter()
            if op in ("lookup", "lookup_local"):
                got = c.lookup(keys)
                ok = got == len(keys)
            else:
                ok = c.get_into(keys[i % len(keys)], view) == SMALL_CHUNK
            dt = time.perf_counter() - t0
            if not ok:
                raise RuntimeError(f"control bench: {op} missed a stored chunk")
            if i >= 20:
                out.append(dt)
    view.release()
    return out


def _worker(socket_path: str, op: str, keys: list[bytes], n: int, barrier: Any,
            results: Any) -> None:
    try:
        barrier.wait(timeout=60)
        results.put(sample(socket_path, op, keys, n))
    except BaseException as e:
        results.put(repr(e))
        raise


def concurrent(socket_path: str, op: str, keys: list[bytes], n: int,
               clients: int) -> list[float]:
    """Pooled samples of `clients` processes each doing n calls at the same time."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(clients)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(socket_path, op, keys, n, barrier, results),
                         daemon=True) for _ in range(clients)]
    for proc in procs:
        proc.start()
    pooled: list[float] = []
    try:
        for _ in range(clients):
            got = results.get(timeout=300)
            if isinstance(got, str):
                raise RuntimeError(f"control bench client failed: {got}")
            pooled.extend(got)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
    return pooled


def _us(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1e6, 1)


def run_control(samples_1c: int, samples_8c: int) -> dict[str, Any]:
    """The `control` section."""
    keys = _keys(PREFIX_CHUNKS)
    with LocalAgent("--no-lock", dram="64Mi", start_timeout=60) as agent:
        sock = str(agent.socket_path)
        with KVPoolClient(sock) as c:
            for k in keys:
                c.put(k, bytes(SMALL_CHUNK))
        out: dict[str, Any] = {}
        for op in ("lookup", "lookup_local", "acquire"):
            one = sample(sock, op, keys, samples_1c)
            eight = concurrent(sock, op, keys, samples_8c, clients=8)
            out[f"{op}_p50_us_1c"] = _us(one, 50)
            out[f"{op}_p99_us_1c"] = _us(one, 99)
            out[f"{op}_p50_us_8c"] = _us(eight, 50)
            out[f"{op}_p99_us_8c"] = _us(eight, 99)
        out["lookup_prefix_chunks"] = PREFIX_CHUNKS
        out["samples_1c"] = samples_1c
        out["samples_8c"] = samples_8c * 8
    return out
