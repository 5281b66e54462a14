"""Scale part of `kvpool bench`: index memory per chunk, LOOKUP latency vs index size.

The agent is filled with many tiny chunks (64 bytes each, one arena page)
by inline PUTs pipelined over one raw protocol connection (batches of 256
frames, then their 256 replies), so filling 10^6 chunks is bounded by the
agent, not by client round trips. Memory is the agent's resident set minus
its file-backed and shared pages (psutil `rss - shared`: the heap where the
index lives, not the arena's pages), sampled before and after the fill.
LOOKUP latency is `KVPoolClient.lookup` of a stored 128-chunk prefix
(the median of 2,000 calls) at each index size.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import psutil

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient

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
