"""Data-path parts of `kvpool bench`: G2 (zero-copy and inline) against memcpy and Redis.

Every figure is the median (with min and max) of `reps` timed operations
after warm-up ones, on pre-faulted buffers, in one process and one thread:

- memcpy: `dst[:] = src` between two pre-faulted bytearrays of the chunk size
  (a single-thread memmove, the copy the zero-copy client itself does);
  beside it, `xxh3_gbps`: the XXH3-64 checksum a put computes over the same
  bytes (a diagnostic: put costs a copy plus this pass);
- G2 put: `KVPoolClient.put` of a new key (ALLOC, copy into the arena,
  XXH3 checksum, COMMIT); the key is deleted untimed afterwards, so the next
  put reuses the same, already faulted, arena pages;
- G2 get: `KVPoolClient.get_into` into a pre-faulted buffer (ACQUIRE, copy
  out of the arena, pipelined RELEASE);
- inline: the same calls with `mode="inline"` (the bytes ride in the frames);
- Redis: redis-py `SET` / `GET` of the same bytes over a Unix socket to a
  `redis-server` started here without persistence.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .bench_stats import gbps, size_label, timed
from .client import KVPoolClient
from .local import LocalAgent
from .protocol import checksum

KEY_PREFIX = b"kvpool-bench-key"


def bench_key(i: int) -> bytes:
    """A distinct 16-byte key per repetition."""
    return i.to_bytes(8, "little") + KEY_PREFIX[:8]


def prefaulted(nbytes: int, fill: int = 0) -> bytearray:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for off in range(0, nbytes, 4096):  # touch every page: no faults in timed copies
        view[off] = fill
    view.release()
    return buf


def payload(nbytes: int) -> bytes:
    """Incompressible-looking bytes (Redis and the checksum see real data)."""
    seed = os.urandom(1 << 16)
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def memcpy_gbps(nbytes: int, reps: int) -> dict[str, float]:
    src = prefaulted(nbytes, 1)
    dst = prefaulted(nbytes, 2)
    s, d = memoryview(src), memoryview(dst)

    def copy(_: int) -> None:
        d[:] = s

    out = gbps(nbytes, timed(copy, reps, warmup=2)).fields("memcpy_gbps")
    # The checksum every put computes (XXH3-64 over the chunk): a second pass.
    out.update(gbps(nbytes, timed(lambda _: checksum(s), reps, warmup=1)).fields("xxh3_gbps"))
    s.release()
    d.release()
    return out


def client_gbps(socket_path: Path, mode: str, data: bytes, reps: int) -> dict[str, float]:
    """put_gbps and get_gbps of one chunk size through a client in `mode`."""
    nbytes = len(data)
    out_buf = prefaulted(nbytes)
    out_view = memoryview(out_buf)
    with KVPoolClient(socket_path, mode=mode) as c:  # type: ignore[arg-type]
        def put(i: int) -> None:
            if not c.put(bench_key(i), data):
                raise RuntimeError("bench key already stored")

        put_times: list[float] = []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            put(i)
            dt = time.perf_counter() - t0
            if i >= 2:
                put_times.append(dt)
            if i < reps + 1:
                c.delete(bench_key(i))
        key = bench_key(reps + 1)

        def get(_: int) -> None:
            if c.get_into(key, out_view) != nbytes:
                raise RuntimeError("bench chunk missing")

        get_times = timed(get, reps, warmup=2)
        if bytes(out_view[:64]) != data[:64]:
            raise RuntimeError("bench chunk read back wrong")
        c.delete(key)
    out_view.release()
    return {**gbps(nbytes, put_times).fields("put_gbps"),
            **gbps(nbytes, get_times).fields("get_gbps")}


@contextlib.contextmanager
def redis_server() -> Iterator[Path]:
    """`redis-server` on a Unix socket in a temp dir, no persistence; stopped after."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (Debian package redis-server)")
    tmp = Path(tempfile.mkdtemp(prefix="kvpool-bench-redis-"))
    sock = tmp / "redis.sock"
    proc = subprocess.Popen(
        [exe, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
         "--save", "", "--appendonly", "no", "--dir", str(tmp),
         "--proto-max-bulk-len", "1gb", "--client-query-buffer-limit", "1gb"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        for _ in range(500):
            if sock.exists():
                break
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}")
            time.sleep(0.01)
        else:
            raise RuntimeError("redis-server did not create its socket in 5s")
        yield sock
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


def redis_gbps(sock: Path, data: bytes, reps: int) -> dict[str, float]:
    import redis

    nbytes = len(data)
    r = redis.Redis(unix_socket_path=str(sock))
    try:
        r.ping()
        put_times = timed(lambda i: r.set(bench_key(i), data), reps, warmup=2)
        r.flushall()
        key = bench_key(0)
        r.set(key, data)

        def get(_: int) -> None:
            got = r.get(key)
            if got is None or len(got) != nbytes:
                raise RuntimeError("redis lost the bench value")

        get_times = timed(get, reps, warmup=2)
        r.flushall()
    finally:
        r.close()
    return {**gbps(nbytes, put_times).fields("put_gbps"),
            **gbps(nbytes, get_times).fields("get_gbps")}


def run_data_path(sizes: list[int], reps: int) -> dict[str, Any]:
    """The `g2`, `inline` and `redis` sections: one entry per chunk size."""
    g2: dict[str, Any] = {}
    inline: dict[str, Any] = {}
    peer: dict[str, Any] = {}
    dram = max(sizes) * 4 + (64 << 20)
    with LocalAgent("--no-lock", dram=str(dram), start_timeout=60) as agent, \
            redis_server() as rsock:
        for nbytes in sizes:
            label = size_label(nbytes)
            data = payload(nbytes)
            g2[label] = {**client_gbps(agent.socket_path, "zero_copy", data, reps),
                         **memcpy_gbps(nbytes, reps)}
            inline[label] = client_gbps(agent.socket_path, "inline", data, reps)
            peer[label] = redis_gbps(rsock, data, reps)
            memcpy = g2[label]["memcpy_gbps"]
            for op in ("put", "get"):
                g2[label][f"{op}_vs_memcpy"] = round(g2[label][f"{op}_gbps"] / memcpy, 3)
                peer[label][f"kvpool_{op}_vs_redis"] = round(
                    g2[label][f"{op}_gbps"] / peer[label][f"{op}_gbps"], 3)
    return {"g2": g2, "inline": inline, "redis": peer}
