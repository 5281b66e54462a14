"""Scale part of `kvpool bench`: index memory per chunk, LOOKUP latency vs index size.

The agent is filled with many tiny chunks (64 bytes each, one arena page)
by inline PUTs pipelined over one raw protocol connection (batches of 256
frames, then their 256 replies), so filling 10^6 chunks is bounded by the
agent, not by client round trips. Memory is the agent's resident set minus
its file-backed and shared pages (psutil `rss - shared`: the heap where the
index lives, not the arena's pages), sampled before and after the fill.
LOOKUP latency is `KVPoolClient.lookup` of a stored 128-chunk prefix
(the median of 2,000 calls) at each index size.

NVMe's index is measured in process (`run_nvme_index`): writing 10^6 chunk
files is too slow for a bench, and the files are not what the heap holds. A
fresh process indexes n chunks as `NvmeTier.write` indexes a file it wrote
(`NvmeIndex.put`) and queues each as a landed demotion does (`queue.add`, the
NVMe tier's default order), and reports its resident set's growth per chunk
(psutil `rss`, before and after, both after a garbage collection), the rate of
that fill, and LOOKUP's NVMe step per key (find the key, update its hit facts,
tell its queue: `ChunkStore.lookup` for a chunk NVMe holds) over keys picked at
random, at each n.
"""

from __future__ import annotations

import gc
import os
import random
import socket
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import psutil

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.agent.config import TierPolicy
from kvpool.agent.tiers.nvmeindex import NvmeIndex

from .local import LocalAgent
from .stats import percentile

TINY = 64
BATCH = 256


def scale_key(i: int) -> bytes:
    return b"scale-\x00\x00" + i.to_bytes(8, "little")


class _Pipe:
    """A raw protocol connection that pipelines inline PUTs."""

    def __init__(self, socket_path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(str(socket_path))
        self.sock.sendall(p.encode(p.Hello(1, p.PROTOCOL_VERSION, "bench-fill", "")))
        msg, fds, _, _ = socket.recv_fds(self.sock, 64 * 1024, 1)
        for fd in fds:
            os.close(fd)
        self.buf = bytearray(msg)
        self._reply()

    def _reply(self) -> p.Reply:
        for _ in range(1_000_000):
            if len(self.buf) >= p.HEADER.size:
                (length,) = p.HEADER.unpack_from(self.buf)
                end = p.HEADER.size + length
                if len(self.buf) >= end:
                    reply: p.Reply = p.reply_decoder.decode(self.buf[p.HEADER.size:end])
                    del self.buf[:end]
                    if isinstance(reply, p.ErrorReply):
                        raise p.ProtocolError(reply.code, reply.message)
                    return reply
            more = self.sock.recv(1 << 20)
            if not more:
                raise ConnectionError("agent closed the connection")
            self.buf += more
        raise ConnectionError("reply never completed")

    def put_range(self, start: int, stop: int, data: bytes) -> None:
        digest = p.checksum(data)
        for lo in range(start, stop, BATCH):
            hi = min(stop, lo + BATCH)
            self.sock.sendall(b"".join(p.encode(p.Put(i + 2, scale_key(i), data, digest))
                                       for i in range(lo, hi)))
            for _ in range(hi - lo):
                self._reply()

    def close(self) -> None:
        self.sock.close()


def _anon_bytes(pid: int) -> int:
    mem = psutil.Process(pid).memory_info()
    return int(mem.rss - mem.shared)


def _lookup_p50_us(socket_path: Path, n_chunks: int, calls: int = 2000) -> float:
    base = max(0, n_chunks // 2 - 64)
    keys = [scale_key(i) for i in range(base, base + 128)]
    out: list[float] = []
    with KVPoolClient(socket_path) as c:
        for i in range(calls + 50):
            t0 = time.perf_counter()
            got = c.lookup(keys)
            dt = time.perf_counter() - t0
            if got != len(keys):
                raise RuntimeError(f"scale bench: lookup found {got} of {len(keys)}")
            if i >= 50:
                out.append(dt)
    return round(percentile(out, 50) * 1e6, 1)


def run_scale(counts: list[int]) -> dict[str, Any]:
    """Fill one agent up to each count in turn; memory per chunk at the largest."""
    counts = sorted(counts)
    # Stay under the DRAM high watermark (95%): no eviction during the fill.
    dram = (counts[-1] * 10 // 9 + 2048) * 4096
    data = b"s" * TINY
    out: dict[str, Any] = {}
    with LocalAgent("--no-lock", dram=str(dram), start_timeout=60) as agent:
        assert agent.proc is not None
        pid = agent.proc.pid
        pipe = _Pipe(agent.socket_path)
        try:
            pipe.put_range(0, 1000, data)  # warm the allocator and the index
            before = _anon_bytes(pid)
            filled = 1000
            lookups: dict[int, float] = {}
            fill_s = 0.0
            for n in counts:
                t0 = time.perf_counter()
                pipe.put_range(filled, n, data)
                fill_s += time.perf_counter() - t0
                filled = max(filled, n)
                lookups[n] = _lookup_p50_us(agent.socket_path, n)
            after = _anon_bytes(pid)
        finally:
            pipe.close()
    out["bytes_per_chunk"] = round((after - before) / (counts[-1] - 1000), 1)
    out["bytes_per_chunk_at"] = counts[-1]
    out["fill_puts_per_second"] = round((counts[-1] - 1000) / fill_s, 1)
    for n, us in lookups.items():
        out[f"lookup_p50_us_{n:.0e}".replace("e+0", "e")] = us
    return out


NVME_FILE_BYTES = 64 * 1024 + 64
"""A 64 KiB chunk's file with its header: 1 TiB of NVMe is ~16M of them."""
LOOKUP_STEPS = 20_000


def nvme_index_key(i: int) -> bytes:
    return b"nvme-\x00\x00\x00" + i.to_bytes(8, "little")


def _nvme_index(n: int) -> dict[str, float]:
    """Index `n` chunks in this (fresh) process: heap growth per chunk, fill rate, and
    LOOKUP's NVMe step per key."""
    proc = psutil.Process()
    index = NvmeIndex()
    queue = index.new_queue(TierPolicy().tiers.nvme.eviction, "last_access")
    gc.collect()
    before = proc.memory_info().rss
    now = time.time()
    t0 = time.perf_counter()
    for i in range(n):
        key = nvme_index_key(i)
        index.put(key, NVME_FILE_BYTES, "", now)  # NvmeTier.write, once the file is in place
        entry = index.get(key)
        assert entry is not None
        entry.last_seq = i  # Demotion._written: the DRAM chunk's facts, then its queue
        queue.add(entry)
    fill_s = time.perf_counter() - t0
    gc.collect()
    grown = proc.memory_info().rss - before
    rnd = random.Random(n)
    keys = [nvme_index_key(rnd.randrange(n)) for _ in range(LOOKUP_STEPS)]
    best = float("inf")
    seq = n
    for _ in range(3):
        t0 = time.perf_counter()
        for key in keys:  # ChunkStore.lookup's step for a key NVMe holds (`Demotion.hit`)
            slot = index.table.find(key)
            seq += 1
            index.facts.hit(slot, seq, 0, now)
            queue.touched_slot(slot, 0)
        best = min(best, time.perf_counter() - t0)
    return {"bytes_per_chunk": round(grown / n, 1), "fill_per_second": round(n / fill_s, 1),
            "lookup_ns_per_key": round(best / len(keys) * 1e9, 1)}


def run_nvme_index(counts: list[int]) -> dict[str, Any]:
    """NVMe's index at each count, each in a fresh process (its heap starts clean)."""
    out: dict[str, Any] = {"nvme_index_order": TierPolicy().tiers.nvme.eviction.value}
    for n in sorted(counts):
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            got = pool.submit(_nvme_index, n).result()
        tag = f"{n:.0e}".replace("e+0", "e")
        out[f"nvme_index_bytes_per_chunk_{tag}"] = got["bytes_per_chunk"]
        out[f"nvme_index_lookup_ns_per_key_{tag}"] = got["lookup_ns_per_key"]
        out["nvme_index_fill_per_second"] = got["fill_per_second"]  # at the largest count
    out["nvme_index_measured_at"] = max(counts)
    return out
