"""Data-path parts of `kvpool bench`: G2 (zero-copy and inline) against memcpy and Redis.

Per chunk size, every operation below is timed once per round, the
operations taking turns (`bench_stats.timed`), for `reps` rounds after two
warm-up ones; each figure is the median over the rounds (with min and max).
Buffers are pre-faulted; one process, one thread:

- memcpy: `dst[:] = src` between two pre-faulted bytearrays of the chunk size
  (a single-thread memmove, the copy the zero-copy client itself does);
  beside it, two diagnostics: `xxh3_gbps`, the XXH3-64 checksum over the
  same bytes on its own, and `copy_xxh3_gbps`, the put's copy-and-hash pass
  (`transport.copy_and_checksum`) between the same two buffers: what a put
  costs without its two round trips (ALLOC, COMMIT); `wsum_gbps`, the WSUM
  checksum (`checksums.Wsum`) over the same bytes, `wsum_vs_xxh3` its speed against
  XXH3's; and the agent's verification of a chunk of either kind as it runs it
  before a demotion or at a re-admission (`Arena.checksum`: the chunk read out of an
  arena file in /dev/shm piece by piece, each piece checksummed while in cache):
  `verify_xxh3_gbps`, `verify_wsum_gbps` and `verify_wsum_vs_xxh3`;
- G2 put: `KVPoolClient.put` of a new key (ALLOC, copy into the arena with
  the checksum computed per 1 MiB block as it is copied, COMMIT);
- G2 put ahead: the same with `put_ahead=True` (one round trip: the previous put's
  COMMIT handed out this put's lease; docs/protocol.md#put-ahead);
- G2 get: `KVPoolClient.get_into` of that key into a pre-faulted buffer
  (ACQUIRE, copy out of the arena, pipelined RELEASE); `get_verified_gbps` the
  same with `verify=True` (XXH3 per 1 MiB block as it is copied), and
  `get_verified_vs_get` what verifying costs a read;
- G2 put_many / get_many: `KVPoolClient.put_many` / `get_many_into` of `BATCH` chunks
  in one window (two round trips for the puts, one for the reads, whatever the
  count): what a batch pays per chunk once its round trips are shared, against
  `BATCH` memcpys;
- inline: the same calls with `mode="inline"` (the bytes ride in the frames);
- Redis: redis-py `SET` / `GET` of the same bytes over a Unix socket to a
  `redis-server` started here without persistence.

The round's keys are deleted untimed at its end, so the next round's puts
reuse the same, already faulted, arena pages.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvpool.agent import checksums
from kvpool.agent.arena import Arena
from kvpool.agent.client import KVPoolClient
from kvpool.agent.protocol import checksum
from kvpool.agent.transport import copy_and_checksum

from .local import LocalAgent
from .stats import child_server, size_label, throughput, timed

KEY_PREFIX = b"kvpool-bench-key"
BATCH = 4
"""Chunks per put_many / get_many window."""


def _shm() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def bench_key(i: int, salt: bytes = b"") -> bytes:
    """A distinct 16-byte key per repetition and `salt` (one per path sharing an agent)."""
    return i.to_bytes(8, "little") + (salt + KEY_PREFIX)[:8]


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


@contextlib.contextmanager
def redis_server() -> Iterator[Path]:
    """`redis-server` on a Unix socket in a temp dir, no persistence; stopped after."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (Debian package redis-server)")
    tmp = Path(tempfile.mkdtemp(prefix="kvpool-bench-redis-"))
    sock = tmp / "redis.sock"
    try:
        with child_server(
                [exe, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
                 "--save", "", "--appendonly", "no", "--dir", str(tmp),
                 "--proto-max-bulk-len", "1gb", "--client-query-buffer-limit", "1gb"],
                ready=sock.exists, what="redis-server"):
            yield sock
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _round(nbytes: int, data: bytes, zc: KVPoolClient, ahead: KVPoolClient,
           inline: KVPoolClient, rds: Any, arena: Arena,
           ) -> tuple[dict[str, Callable[[int], object]], Callable[[int], object]]:
    """The operations one round times, in turn, and the clean-up after a round."""
    src, dst = prefaulted(nbytes, 1), prefaulted(nbytes, 2)
    arena.write([(0, nbytes)], data)
    s, d = memoryview(src), memoryview(dst)
    out = memoryview(prefaulted(nbytes))
    src[:] = data  # the same bytes every path moves

    def copy(_: int) -> None:
        d[:] = s

    def put(client: KVPoolClient, salt: bytes) -> Callable[[int], object]:
        def call(i: int) -> None:
            if not client.put(bench_key(i, salt), data):
                raise RuntimeError("bench key already stored")
        return call

    def get(client: KVPoolClient, salt: bytes, verify: bool = False) -> Callable[[int], object]:
        def call(i: int) -> None:
            got = client.get_into(bench_key(i, salt), out, verify=verify)
            if got != nbytes or out[:64] != data[:64]:
                raise RuntimeError("bench chunk missing or read back wrong")
        return call

    outs = [memoryview(prefaulted(nbytes)) for _ in range(BATCH)]

    def batch(i: int) -> list[bytes]:
        return [bench_key(i * BATCH + j, b"batch") for j in range(BATCH)]

    def put_many(i: int) -> None:
        if not all(zc.put_many(batch(i), [data] * BATCH)):
            raise RuntimeError("bench batch not stored")

    def get_many(i: int) -> None:
        sizes = zc.get_many_into(batch(i), lambda j, size, meta: outs[j], verify=False)
        if sizes != [nbytes] * BATCH or any(o[:64] != data[:64] for o in outs):
            raise RuntimeError("bench batch missing or read back wrong")

    def redis_get(i: int) -> None:
        got = rds.get(bench_key(i, b"redis"))
        if got is None or len(got) != nbytes:
            raise RuntimeError("redis lost the bench value")

    def copy_and_hash(_: int) -> None:
        copy_and_checksum(d, [(0, nbytes)], s, b"")

    ops: dict[str, Callable[[int], object]] = {
        "memcpy": copy, "xxh3": lambda _: checksum(s), "copy_xxh3": copy_and_hash,
        "wsum": lambda _: checksums.compute(checksums.WSUM, [s]),
        "verify_xxh3": lambda _: arena.checksum([(0, nbytes)], b"", checksums.XXH3),
        "verify_wsum": lambda _: arena.checksum([(0, nbytes)], b"", checksums.WSUM),
        "put": put(zc, b"g2"), "put_ahead": put(ahead, b"ahead"), "get": get(zc, b"g2"),
        "get_verified": get(zc, b"g2", True), "put_many": put_many, "get_many": get_many,
        "inline_put": put(inline, b"inline"), "inline_get": get(inline, b"inline"),
        "redis_put": lambda i: rds.set(bench_key(i, b"redis"), data), "redis_get": redis_get,
    }

    def clean(i: int) -> None:
        zc.delete(bench_key(i, b"g2"))
        zc.delete(bench_key(i, b"ahead"))
        inline.delete(bench_key(i, b"inline"))
        for key in batch(i):
            zc.delete(key)
        rds.delete(bench_key(i, b"redis"))

    return ops, clean


def run_data_path(sizes: list[int], reps: int) -> dict[str, Any]:
    """The `g2`, `inline` and `redis` sections: one entry per chunk size."""
    import redis

    g2: dict[str, Any] = {}
    inline: dict[str, Any] = {}
    peer: dict[str, Any] = {}
    dram = max(sizes) * (4 + BATCH) + (64 << 20)
    with LocalAgent("--no-lock", dram=str(dram), start_timeout=60) as agent, \
            redis_server() as rsock, \
            KVPoolClient(agent.socket_path) as zc, \
            KVPoolClient(agent.socket_path, put_ahead=True) as ahead, \
            KVPoolClient(agent.socket_path, mode="inline") as ic, \
            contextlib.closing(redis.Redis(unix_socket_path=str(rsock))) as rds, \
            tempfile.TemporaryDirectory(dir=_shm()) as scratch:
        rds.ping()
        # the agent's own arena class, on a file where the agent keeps its arena
        arena = Arena(Path(scratch) / "arena", max(sizes), lock=False)
        try:
            for nbytes in sizes:
                label = size_label(nbytes)
                ops, clean = _round(nbytes, payload(nbytes), zc, ahead, ic, rds, arena)
                t = timed(ops, reps, warmup=2, after=clean)
                g2[label], inline[label], peer[label] = _figures(nbytes, t)
        finally:
            arena.close()
    return {"g2": g2, "inline": inline, "redis": peer}


def _figures(nbytes: int, t: dict[str, list[float]]
             ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """One chunk size's `g2`, `inline` and `redis` entries from its rounds' timings."""
    g2 = throughput(nbytes, {
        "put_gbps": t["put"], "put_ahead_gbps": t["put_ahead"], "get_gbps": t["get"],
        "memcpy_gbps": t["memcpy"],
        "xxh3_gbps": t["xxh3"], "copy_xxh3_gbps": t["copy_xxh3"], "wsum_gbps": t["wsum"],
        "verify_xxh3_gbps": t["verify_xxh3"], "verify_wsum_gbps": t["verify_wsum"],
        "get_verified_gbps": t["get_verified"]})
    g2.update(throughput(BATCH * nbytes, {
        "put_many_gbps": t["put_many"], "get_many_gbps": t["get_many"]}))
    inline = throughput(nbytes, {"put_gbps": t["inline_put"], "get_gbps": t["inline_get"]})
    peer = throughput(nbytes, {"put_gbps": t["redis_put"], "get_gbps": t["redis_get"]})
    memcpy = g2["memcpy_gbps"]
    g2["wsum_vs_xxh3"] = round(g2["wsum_gbps"] / g2["xxh3_gbps"], 3)
    g2["verify_wsum_vs_xxh3"] = round(g2["verify_wsum_gbps"] / g2["verify_xxh3_gbps"], 3)
    g2["put_ahead_vs_memcpy"] = round(g2["put_ahead_gbps"] / memcpy, 3)
    for op in ("put_many", "get_many"):
        g2[f"{op}_vs_memcpy"] = round(g2[f"{op}_gbps"] / memcpy, 3)
    for op in ("put", "get"):
        g2[f"{op}_vs_memcpy"] = round(g2[f"{op}_gbps"] / memcpy, 3)
        peer[f"kvpool_{op}_vs_redis"] = round(g2[f"{op}_gbps"] / peer[f"{op}_gbps"], 3)
    # What verify=True costs a zero-copy read (hashed in the same pass as the copy).
    g2["get_verified_vs_get"] = round(g2["get_verified_gbps"] / g2["get_gbps"], 3)
    return g2, inline, peer
