"""Batched zero-copy calls for engine integrations.

Engines hand their store whole batches of chunks. `KVPoolClient` makes one
request-reply exchange per op; `PipelinedClient` writes a batch's requests
in one go and then reads their replies, which the agent sends in request
order. A batch of N reads therefore costs one round trip (ACQUIRE; the
RELEASEs are not waited for) and a batch of N writes two (ALLOC, then
COMMIT), whatever N is up to the window.

Chunk bytes still never cross the socket: reads copy from the arena mapping
straight into the buffer the engine supplies, writes copy from the engine's
buffer into the arena.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from .. import protocol as p
from ..client import Buffer, KVPoolClient, _as_bytes_view

ReadTarget = Callable[[int, int, bytes], Buffer | None]
"""`target(index, size, meta)`: where to copy the chunk of `keys[index]`, or None to skip it."""

PutResult = bool | p.ProtocolError
"""True: stored now; False: already stored (deduplicated); an error: the agent refused it."""

DEFAULT_WINDOW = 128
"""Requests in flight per batch step: bounds queued replies and leases held."""


class PipelinedClient(KVPoolClient):
    """A zero-copy `KVPoolClient` with batch calls that pipeline their requests.

    Not thread-safe, like `KVPoolClient`: an integration that is called from
    several threads holds a lock around it.
    """

    def __init__(self, *args: Any, window: int = DEFAULT_WINDOW, **kwargs: Any) -> None:
        kwargs.setdefault("mode", "zero_copy")
        super().__init__(*args, **kwargs)
        if self._arena is None:
            raise ValueError("PipelinedClient reads and writes through the arena: zero_copy only")
        self.window = window

    def _step(self) -> int:
        # Never hold more leases at once than the agent grants one connection.
        limit = self.hello.max_leases if self.hello is not None else self.window
        return max(1, min(self.window, limit))

    def _exchange(self, reqs: Sequence[p.Request]) -> list[p.Reply]:
        """Send `reqs` in one write; their replies, error replies included, in order."""
        if not reqs:
            return []
        if self._sock is None:
            self._reconnect()
        assert self._sock is not None
        self._sock.sendall(b"".join(p.encode(r) for r in reqs))
        while self._unanswered:
            # Replies to earlier fire-and-forget RELEASEs/ABORTs come first.
            self._unanswered -= 1
            self._read_reply()
        return [self._read_reply() for _ in reqs]

    def _cast_all(self, reqs: Sequence[p.Request]) -> None:
        """Send without waiting; the replies are read before the next exchange's."""
        if not reqs or self._sock is None:
            return
        try:
            self._sock.sendall(b"".join(p.encode(r) for r in reqs))
        except OSError:
            # The agent drops a closed connection's leases itself; the next
            # call reconnects. Raising here would redo work already handed out.
            self._drop_socket()
            return
        self._unanswered += len(reqs)

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the pool holds, in one LOOKUP per 8192 keys."""
        found = 0
        for start in range(0, len(keys), p.MAX_LOOKUP_KEYS):
            window = keys[start : start + p.MAX_LOOKUP_KEYS]
            hit = self.lookup(window)
            found += hit
            if hit < len(window):
                break
        return found

    # -- reads

    def get_many_into(self, keys: Sequence[bytes], target: ReadTarget, *,
                      verify: bool = False) -> list[int]:
        """Copy each stored chunk into the buffer `target` gives for it.

        Returns the size read per key, 0 for a miss, a chunk `target`
        declined, or (with `verify`) a chunk that failed its checksum. The
        chunk's metadata reaches `target` before any byte is copied, so the
        engine can size and shape its buffer from it.
        """
        sizes = [0] * len(keys)
        step = self._step()
        for start in range(0, len(keys), step):
            window = keys[start : start + step]
            self._retrying(partial(self._get_window, window, start, target, sizes, verify))
        return sizes

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
                dst = _as_bytes_view(out)
                if dst.nbytes < reply.size:
                    raise ValueError(f"chunk of {reply.size} bytes does not fit in {dst.nbytes}")
                self._copy_out(reply.extents, dst)
                if verify and p.checksum(dst[: reply.size], reply.meta) != reply.checksum:
                    continue
                sizes[start + i] = reply.size
        finally:
            self._cast_all([p.Release(next(self._rid), r.lease) for r in granted])

    def _copy_out(self, extents: p.Extents, dst: memoryview) -> None:
        assert self._arena is not None
        pos = 0
        for offset, nbytes in extents:
            dst[pos : pos + nbytes] = self._arena[offset : offset + nbytes]
            pos += nbytes

    # -- writes

    def put_many(self, keys: Sequence[bytes], data: Sequence[Buffer],
                 metas: Sequence[bytes]) -> list[PutResult]:
        """Store each buffer under its key with its metadata; one result per key."""
        if not len(keys) == len(data) == len(metas):
            raise ValueError("put_many needs as many buffers and metas as keys")
        views = [_as_bytes_view(d) for d in data]
        results: list[PutResult] = [False] * len(keys)
        step = self._step()
        for start in range(0, len(keys), step):
            end = start + step
            self._retrying(partial(self._put_window, keys[start:end], views[start:end],
                                   metas[start:end], start, results))
        return results

    def _put_window(self, keys: Sequence[bytes], views: Sequence[memoryview],
                    metas: Sequence[bytes], start: int, results: list[PutResult]) -> None:
        digests = [p.checksum(v, m) for v, m in zip(views, metas, strict=True)]
        replies = self._exchange([p.Alloc(next(self._rid), k, v.nbytes, m)
                                  for k, v, m in zip(keys, views, metas, strict=True)])
        commits: list[tuple[int, p.Commit]] = []
        try:
            for i, reply in enumerate(replies):
                if isinstance(reply, p.ErrorReply):
                    results[start + i] = p.ProtocolError(reply.code, reply.message)
                    continue
                assert isinstance(reply, p.AllocReply)
                if reply.exists:
                    results[start + i] = False
                    continue
                self._copy_in(reply.extents, views[i])
                commits.append((i, p.Commit(next(self._rid), reply.lease, digests[i])))
        except BaseException:
            self._cast_all([p.Abort(next(self._rid), c.lease) for _, c in commits])
            raise
        for (i, _), reply in zip(commits, self._exchange([c for _, c in commits]), strict=True):
            results[start + i] = (p.ProtocolError(reply.code, reply.message)
                                  if isinstance(reply, p.ErrorReply) else True)

    def _copy_in(self, extents: p.Extents, src: memoryview) -> None:
        assert self._arena is not None
        pos = 0
        for offset, nbytes in extents:
            self._arena[offset : offset + nbytes] = src[pos : pos + nbytes]
            pos += nbytes
