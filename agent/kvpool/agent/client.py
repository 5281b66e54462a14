"""The client library inference processes import.

`KVPoolClient` talks to the node's agent over its Unix socket. In the default
zero-copy mode it maps the agent's DRAM arena (the fd arrives with the HELLO
reply) and moves chunk bytes straight between the caller's buffers and the
mapping; only ~100-byte control frames cross the socket. Inline mode sends
the bytes in the frames instead (same semantics, for clients that cannot map
shared memory).

If the agent restarts, the client reconnects with backoff, maps the new
arena, and retries the call that failed; leases never survive a reconnect,
so a retried put or get starts over.
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal, TypeVar

import xxhash

from . import protocol as p

T = TypeVar("T")
Buffer = Any
"""Anything exporting the buffer protocol: bytes, bytearray, memoryview, numpy arrays."""

_TIER_NAMES = {2: "dram", 3: "nvme", 4: "shared"}
BATCH_WINDOW = 128
"""Requests a batch call keeps in flight: bounds queued replies and leases held at once."""

ReadTarget = Callable[[int, int, bytes], Buffer | None]
"""`target(index, size, meta)`: where `get_many_into` copies the chunk of `keys[index]`,
or None to skip it. It sees the chunk's size and metadata before any byte is copied."""

PutResult = bool | p.ProtocolError
"""Per key of `put_many`: True stored now, False already stored (deduplicated), or the
agent's refusal of that one chunk."""
COPY_BLOCK = 1 << 20
"""Bytes a put copies into the arena before hashing them: small enough that the block
is still in L2 when the checksum reads it back, large enough that the per-block
Python overhead (~1 µs) is noise. 0.5-2 MiB measured alike here; 4 MiB was slower."""


class AgentUnavailable(ConnectionError):
    """The agent could not be reached within the reconnect budget."""


def _as_bytes_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("chunk buffers must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _fits(dst: memoryview, size: int) -> memoryview:
    if dst.nbytes < size:
        raise ValueError(f"chunk of {size} bytes does not fit in {dst.nbytes}")
    return dst


def _copy_and_checksum(arena: memoryview, extents: Sequence[tuple[int, int]], src: memoryview,
                       meta: bytes) -> int:
    """Copy `src` into the arena extents and return `protocol.checksum(src, meta)`.

    One pass instead of two: each block is hashed right after it is copied,
    while it is still in the CPU cache, so the checksum reads cache rather than
    memory and a put costs about one copy (XXH3's streaming digest equals the
    one-shot digest of meta then data).
    """
    h = xxhash.xxh3_64()
    h.update(meta)
    pos = 0
    for offset, nbytes in extents:
        end = pos + nbytes
        while pos < end:
            step = min(COPY_BLOCK, end - pos)
            block = src[pos : pos + step]
            arena[offset : offset + step] = block
            h.update(block)
            offset += step
            pos += step
    return int(h.intdigest())


class KVPoolClient:
    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        mode: Literal["zero_copy", "inline"] = "zero_copy",
        tenant: str | None = None,
        name: str = "",
        reconnect_timeout: float = 10.0,
        timeout: float = 30.0,
        batch_window: int = BATCH_WINDOW,
    ) -> None:
        path = socket_path if socket_path is not None else os.environ.get("KVPOOL_SOCKET")
        if not path:
            raise ValueError("no agent socket: pass socket_path or set KVPOOL_SOCKET")
        self.socket_path = os.fspath(path)
        self.mode = mode
        self.tenant = tenant if tenant is not None else os.environ.get("KVPOOL_TENANT", "")
        self.name = name
        self.reconnect_timeout = reconnect_timeout
        self.timeout = timeout
        self.batch_window = batch_window
        self._rid = itertools.count(1)
        self._sock: socket.socket | None = None
        self._mm: mmap.mmap | None = None
        self._arena: memoryview | None = None
        self._unanswered = 0
        self._rbuf = bytearray(64 * 1024)
        self.hello: p.HelloReply | None = None
        self._connect()

    # -- connection

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
            rid = next(self._rid)
            sock.sendall(p.encode(p.Hello(rid, p.PROTOCOL_VERSION, self.name, self.tenant)))
            msg, fds, _, _ = socket.recv_fds(sock, 64 * 1024, 1)
            frame = bytearray(msg)
            if len(frame) < p.HEADER.size:
                raise ConnectionError("agent closed the connection during HELLO")
            (length,) = p.HEADER.unpack_from(frame)
            while len(frame) < p.HEADER.size + length:
                more = sock.recv(p.HEADER.size + length - len(frame))
                if not more:
                    raise ConnectionError("agent closed the connection during HELLO")
                frame += more
            reply = p.reply_decoder.decode(frame[p.HEADER.size :])
            if isinstance(reply, p.ErrorReply):
                for fd in fds:
                    os.close(fd)
                raise p.ProtocolError(reply.code, reply.message)
            assert isinstance(reply, p.HelloReply)
        except BaseException:
            sock.close()
            raise
        self._close_mapping()
        if fds:
            try:
                if self.mode == "zero_copy":
                    # MAP_POPULATE: fault the whole arena in now, not on first copy.
                    self._mm = mmap.mmap(fds[0], reply.arena_bytes,
                                         flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
                    self._arena = memoryview(self._mm)
            finally:
                for fd in fds:
                    os.close(fd)
        elif self.mode == "zero_copy":
            sock.close()
            raise ConnectionError("agent sent no arena fd with its HELLO reply")
        self._sock = sock
        self._unanswered = 0
        self.hello = reply

    def _reconnect(self) -> None:
        self._drop_socket()
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.02
        while True:
            try:
                self._connect()
                return
            except (OSError, p.ProtocolError) as e:
                if time.monotonic() + delay > deadline:
                    raise AgentUnavailable(
                        f"agent at {self.socket_path} unreachable for "
                        f"{self.reconnect_timeout:.0f}s: {e}") from e
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _close_mapping(self) -> None:
        if self._arena is not None:
            self._arena.release()
            self._arena = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def close(self) -> None:
        self._drop_socket()
        self._close_mapping()

    def __enter__(self) -> KVPoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- framing

    def _recv_exact(self, n: int) -> memoryview:
        assert self._sock is not None
        if len(self._rbuf) < n:
            self._rbuf = bytearray(n)
        view = memoryview(self._rbuf)[:n]
        got = 0
        while got < n:
            r = self._sock.recv_into(view[got:], n - got)
            if r == 0:
                raise ConnectionError("agent closed the connection")
            got += r
        return view

    def _read_reply(self) -> p.Reply:
        (length,) = p.HEADER.unpack(self._recv_exact(p.HEADER.size))
        reply: p.Reply = p.reply_decoder.decode(self._recv_exact(length))
        return reply

    def _send(self, req: p.Request) -> None:
        if self._sock is None:
            self._reconnect()
        assert self._sock is not None
        self._sock.sendall(p.encode(req))

    def _call(self, req: p.Request) -> p.Reply:
        self._send(req)
        while self._unanswered:
            # Replies to fire-and-forget RELEASEs come first; a failed release
            # only means the lease was already gone.
            self._unanswered -= 1
            self._read_reply()
        reply = self._read_reply()
        if isinstance(reply, p.ErrorReply):
            raise p.ProtocolError(reply.code, reply.message)
        return reply

    def _cast(self, req: p.Request) -> None:
        """Send without waiting; the reply is read before the next call's."""
        self._send(req)
        self._unanswered += 1

    def _retrying(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (ConnectionError, TimeoutError, OSError) as e:
            if isinstance(e, AgentUnavailable):
                raise
            self._reconnect()
            return fn()

    # -- API

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the pool holds (in any tier)."""
        return len(self.lookup_tiers(keys))

    def lookup_tiers(self, keys: Sequence[bytes]) -> list[str]:
        """The tier of each key of the longest stored prefix: "dram", "nvme" or "shared".

        A prefix longer than one LOOKUP takes (`MAX_LOOKUP_KEYS`) is asked in windows,
        the next only while the previous one was a hit all the way.
        """
        def call(window: Sequence[bytes]) -> list[str]:
            reply = self._call(p.Lookup(next(self._rid), list(window)))
            assert isinstance(reply, p.LookupReply)
            return [_TIER_NAMES.get(t, str(t)) for t in reply.tiers]

        tiers: list[str] = []
        for start in range(0, max(len(keys), 1), p.MAX_LOOKUP_KEYS):
            window = keys[start : start + p.MAX_LOOKUP_KEYS]
            found = self._retrying(partial(call, window))
            tiers += found
            if len(found) < len(window):
                break
        return tiers

    def contains(self, key: bytes) -> bool:
        return self.lookup([key]) == 1

    def put(self, key: bytes, data: Buffer, meta: bytes = b"") -> bool:
        """Store a chunk; False if the key was already stored (deduplicated)."""
        src = _as_bytes_view(data)
        return self._retrying(lambda: self._put_once(key, src, meta))

    def _put_once(self, key: bytes, src: memoryview, meta: bytes) -> bool:
        if self._arena is None:
            digest = p.checksum(src, meta)
            reply = self._call(p.Put(next(self._rid), key, bytes(src), digest, meta))
            assert isinstance(reply, p.PutReply)
            return reply.stored
        alloc = self._call(p.Alloc(next(self._rid), key, src.nbytes, meta))
        assert isinstance(alloc, p.AllocReply)
        if alloc.exists:
            return False
        try:
            digest = _copy_and_checksum(self._arena, alloc.extents, src, meta)
        except BaseException:
            self._cast(p.Abort(next(self._rid), alloc.lease))
            raise
        self._call(p.Commit(next(self._rid), alloc.lease, digest))
        return True

    def get(self, key: bytes, *, verify: bool = False) -> bytes | None:
        """The chunk's bytes, or None on a miss."""
        got = self.get_with_meta(key, verify=verify)
        return None if got is None else got[0]

    def get_with_meta(self, key: bytes, *, verify: bool = False) -> tuple[bytes, bytes] | None:
        def call() -> tuple[bytes, bytes] | None:
            if self._arena is None:
                try:
                    reply = self._call(p.Get(next(self._rid), key))
                except p.ProtocolError as e:
                    if e.code == p.ErrorCode.NOT_FOUND:
                        return None
                    raise
                assert isinstance(reply, p.GetReply)
                if verify and p.checksum(reply.data, reply.meta) != reply.checksum:
                    return None
                return reply.data, reply.meta
            lease = self._acquire(key)
            if lease is None:
                return None
            try:
                arena = self._arena
                data = b"".join(arena[o : o + n] for o, n in lease.extents) \
                    if len(lease.extents) > 1 else bytes(
                        arena[lease.extents[0][0] : lease.extents[0][0] + lease.size])
            finally:
                self._cast(p.Release(next(self._rid), lease.lease))
            if verify and p.checksum(data, lease.meta) != lease.checksum:
                return None
            return data, lease.meta
        return self._retrying(call)

    def get_into(self, key: bytes, out: Buffer, *, verify: bool = False) -> int:
        """Copy the chunk into `out`; returns its size, or 0 on a miss."""
        dst = _as_bytes_view(out)

        def call() -> int:
            if self._arena is None:
                got = self.get_with_meta(key, verify=verify)
                if got is None:
                    return 0
                data = got[0]
                _fits(dst, len(data))[: len(data)] = data
                return len(data)
            lease = self._acquire(key)
            if lease is None:
                return 0
            try:
                self._copy_out(lease.extents, _fits(dst, lease.size))
            finally:
                self._cast(p.Release(next(self._rid), lease.lease))
            if verify and p.checksum(dst[: lease.size], lease.meta) != lease.checksum:
                return 0
            return lease.size
        return self._retrying(call)

    # -- batches: one round trip for N reads, two for N writes

    def get_many_into(self, keys: Sequence[bytes], target: ReadTarget, *,
                      verify: bool = False) -> list[int]:
        """Copy each stored chunk into the buffer `target(index, size, meta)` gives for it.

        The ACQUIREs of a window go out in one write and their replies come back in
        order, so a batch costs one round trip (RELEASEs are not waited for). Returns
        the size read per key: 0 for a miss, a chunk `target` declined, or (with
        `verify`) a chunk that failed its checksum. Inline mode reads key by key.
        """
        sizes = [0] * len(keys)
        if self._arena is None:
            for i, key in enumerate(keys):
                got = self.get_with_meta(key, verify=verify)
                out = None if got is None else target(i, len(got[0]), got[1])
                if got is not None and out is not None:
                    dst = _fits(_as_bytes_view(out), len(got[0]))
                    dst[: len(got[0])] = got[0]
                    sizes[i] = len(got[0])
            return sizes
        step = self._batch_step()
        for start in range(0, len(keys), step):
            window = keys[start : start + step]
            self._retrying(partial(self._get_window, window, start, target, sizes, verify))
        return sizes

    def put_many(self, keys: Sequence[bytes], data: Sequence[Buffer],
                 metas: Sequence[bytes] | None = None) -> list[PutResult]:
        """Store each buffer under its key (with its metadata); one result per key.

        Zero-copy: the ALLOCs of a window go out in one write, the bytes are copied
        into the arena, then the COMMITs go out in one write: two round trips. A chunk
        the agent refuses (no space, too large) fails alone. Inline mode puts key by key.
        """
        metas = metas if metas is not None else [b""] * len(keys)
        if not len(keys) == len(data) == len(metas):
            raise ValueError("put_many needs as many buffers and metas as keys")
        views = [_as_bytes_view(d) for d in data]
        results: list[PutResult] = [False] * len(keys)
        if self._arena is None:
            for i, (key, view, meta) in enumerate(zip(keys, views, metas, strict=True)):
                try:
                    results[i] = self.put(key, view, meta)
                except p.ProtocolError as e:
                    results[i] = e
            return results
        step = self._batch_step()
        for start in range(0, len(keys), step):
            end = start + step
            self._retrying(partial(self._put_window, keys[start:end], views[start:end],
                                   metas[start:end], start, results))
        return results

    def _batch_step(self) -> int:
        # Never hold more leases at once than the agent grants one connection.
        limit = self.hello.max_leases if self.hello is not None else self.batch_window
        return max(1, min(self.batch_window, limit))

    def _exchange(self, reqs: Sequence[p.Request]) -> list[p.Reply]:
        """Send `reqs` in one write; their replies, error replies included, in order."""
        if not reqs:
            return []
        if self._sock is None:
            self._reconnect()
        assert self._sock is not None
        self._sock.sendall(b"".join(p.encode(r) for r in reqs))
        while self._unanswered:
            self._unanswered -= 1  # replies to earlier RELEASEs/ABORTs come first
            self._read_reply()
        return [self._read_reply() for _ in reqs]

    def _cast_all(self, reqs: Sequence[p.Request]) -> None:
        """Send without waiting; the replies are read before the next call's."""
        if not reqs or self._sock is None:
            return
        try:
            self._sock.sendall(b"".join(p.encode(r) for r in reqs))
        except OSError:
            # The agent drops a closed connection's leases itself; the next call
            # reconnects. Raising here would redo work already handed out.
            self._drop_socket()
            return
        self._unanswered += len(reqs)

    def _get_window(self, keys: Sequence[bytes], start: int, target: ReadTarget,
                    sizes: list[int], verify: bool) -> None:
        replies = self._exchange([p.Acquire(next(self._rid), k) for k in keys])
        granted = [r for r in replies if isinstance(r, p.AcquireReply)]
        try:
            for i, reply in enumerate(replies):
                if isinstance(reply, p.ErrorReply):
                    if reply.code != p.ErrorCode.NOT_FOUND:
                        raise p.ProtocolError(reply.code, reply.message)
                    continue
                assert isinstance(reply, p.AcquireReply)
                out = target(start + i, reply.size, reply.meta)
                if out is None:
                    continue
                dst = _fits(_as_bytes_view(out), reply.size)
                self._copy_out(reply.extents, dst)
                if verify and p.checksum(dst[: reply.size], reply.meta) != reply.checksum:
                    continue
                sizes[start + i] = reply.size
        finally:
            self._cast_all([p.Release(next(self._rid), r.lease) for r in granted])

    def _put_window(self, keys: Sequence[bytes], views: Sequence[memoryview],
                    metas: Sequence[bytes], start: int, results: list[PutResult]) -> None:
        replies = self._exchange([p.Alloc(next(self._rid), k, v.nbytes, m)
                                  for k, v, m in zip(keys, views, metas, strict=True)])
        commits: list[tuple[int, p.Commit]] = []
        leases = [r.lease for r in replies if isinstance(r, p.AllocReply) and not r.exists]
        try:
            for i, reply in enumerate(replies):
                if isinstance(reply, p.ErrorReply):
                    results[start + i] = p.ProtocolError(reply.code, reply.message)
                    continue
                assert isinstance(reply, p.AllocReply)
                if reply.exists:
                    results[start + i] = False
                    continue
                assert self._arena is not None
                digest = _copy_and_checksum(self._arena, reply.extents, views[i], metas[i])
                commits.append((i, p.Commit(next(self._rid), reply.lease, digest)))
        except BaseException:
            self._cast_all([p.Abort(next(self._rid), lease) for lease in leases])
            raise
        for (i, _), reply in zip(commits, self._exchange([c for _, c in commits]), strict=True):
            results[start + i] = (p.ProtocolError(reply.code, reply.message)
                                  if isinstance(reply, p.ErrorReply) else True)

    def _copy_out(self, extents: p.Extents, dst: memoryview) -> None:
        assert self._arena is not None
        pos = 0
        for offset, nbytes in extents:
            dst[pos : pos + nbytes] = self._arena[offset : offset + nbytes]
            pos += nbytes

    def _acquire(self, key: bytes) -> p.AcquireReply | None:
        try:
            reply = self._call(p.Acquire(next(self._rid), key))
        except p.ProtocolError as e:
            if e.code == p.ErrorCode.NOT_FOUND:
                return None
            raise
        assert isinstance(reply, p.AcquireReply)
        return reply

    def delete(self, key: bytes) -> bool:
        def call() -> bool:
            reply = self._call(p.Delete(next(self._rid), key))
            assert isinstance(reply, p.DeleteReply)
            return reply.existed
        return self._retrying(call)

    def pin(self, key: bytes) -> None:
        self._retrying(lambda: self._call(p.Pin(next(self._rid), key)))

    def unpin(self, key: bytes) -> None:
        self._retrying(lambda: self._call(p.Unpin(next(self._rid), key)))

    def stats(self) -> dict[str, Any]:
        def call() -> dict[str, Any]:
            reply = self._call(p.Stats(next(self._rid)))
            assert isinstance(reply, p.StatsReply)
            return reply.stats
        return self._retrying(call)
