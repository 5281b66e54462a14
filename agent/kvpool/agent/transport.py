"""How chunk bytes travel between a client and its agent: two transports, one interface.

`ZeroCopyTransport` maps the agent's DRAM arena (its fd arrives with the HELLO
reply) and copies chunk bytes between the caller's buffers and the mapping;
only control frames (ALLOC/COMMIT, ACQUIRE/RELEASE) cross the socket.
`InlineTransport` carries the bytes in PUT/GET frames, for clients that cannot
map shared memory. Both speak through one `Connection` (framing, request ids,
pipelined replies); `KVPoolClient` picks one at connect time and never branches
on the mode again.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future
from typing import Any, Literal, Protocol, TypeVar

import xxhash

from . import checksums, copythreads
from . import protocol as p
from .chunkblocks import blocks
from .hostcopy import HostRanges, HostReads, address_of, scatter
from .lookupindex import IndexReader
from .putwindows import CopiesOf, PutCall, write_windows

Buffer = Any
"""Anything exporting the buffer protocol: bytes, bytearray, memoryview, numpy arrays."""

Mode = Literal["zero_copy", "inline"]

_Dst = TypeVar("_Dst")

ReadTarget = Callable[[int, int, bytes], Buffer | HostRanges | None]
"""`target(index, size, meta)`: where `get_many_into` copies the chunk of `keys[index]`,
or None to skip it. It sees the chunk's size and metadata before any byte is copied."""

Meanwhile = Callable[[], object] | None
"""Work of the caller's that a read does while the agent answers its first ACQUIREs (e.g.
planning where the chunks go): called once, right after they are sent."""

PutResult = bool | p.ProtocolError
"""Per key of `put_many`: True stored now, False already stored (deduplicated), or the
agent's refusal of that one chunk."""

TELL_AHEAD = 16
"""Told requests (`Connection.tell`) whose replies may be outstanding at once: more, and
the agent is behind this client, which stops telling it until it catches up."""
TELL_BATCH = 8
"""Told requests sent in one write when no call takes them along sooner."""

_HELLO_RECV = 64 * 1024
_READ_AHEAD = 64 * 1024
"""Bytes a read of replies asks the socket for at once (frames up to this are read ahead)."""


def as_bytes_view(data: Buffer) -> memoryview:
    """A flat byte view of a C-contiguous buffer (any format, any shape)."""
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("chunk buffers must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def fits(dst: memoryview, size: int) -> memoryview:
    if dst.nbytes < size:
        raise ValueError(f"chunk of {size} bytes does not fit in {dst.nbytes}")
    return dst


def acquired(replies: Sequence[p.Reply], start: int,
             target: Callable[[int, int, bytes], _Dst | None]
             ) -> Iterator[tuple[int, p.AcquireReply, _Dst]]:
    """The granted chunks among a window's ACQUIRE replies, each as (index in the window,
    reply, the destination `target` gives it); one it gives no destination is skipped, a
    miss too, and any other error raised."""
    for i, reply in enumerate(replies):
        if isinstance(reply, p.ErrorReply):
            if reply.code != p.ErrorCode.NOT_FOUND:
                raise p.ProtocolError(reply.code, reply.message)
            continue
        assert isinstance(reply, p.AcquireReply)
        out = target(start + i, reply.size, reply.meta)
        if out is not None:
            yield i, reply, out


def copy_and_checksum(arena: memoryview, extents: Sequence[tuple[int, int]], src: memoryview,
                      meta: bytes) -> int:
    """Copy `src` into the arena extents and return `protocol.checksum(src, meta)`.

    One pass instead of two: each block is hashed right after it is copied,
    while it is still in the CPU cache, so the checksum reads cache rather than
    memory and a put costs about one copy (XXH3's streaming digest equals the
    one-shot digest of meta then data).
    """
    h = xxhash.xxh3_64(meta)
    for offset, pos, step in blocks(extents):
        block = src[pos : pos + step]
        arena[offset : offset + step] = block
        h.update(block)
    return int(h.intdigest())


def copy_out(arena: memoryview, extents: Sequence[tuple[int, int]], dst: memoryview,
             check: p.AcquireReply | None = None) -> bool:
    """Copy a chunk's arena extents into `dst`. With `check` (the chunk's ACQUIRE reply),
    also verify the copy against the chunk's checksum and return whether it matched.

    An XXH3 chunk is verified in the same pass as the copy: each block is hashed right
    after it is copied, while it is still in the CPU cache (as `copy_and_checksum` does
    for a put), which costs far less than hashing the whole copy again afterwards.
    """
    if check is None or check.checksum_kind != checksums.XXH3:
        pos = 0
        for offset, nbytes in extents:
            dst[pos : pos + nbytes] = arena[offset : offset + nbytes]
            pos += nbytes
        return check is None or p.checksum(dst[: check.size], check.meta,
                                           check.checksum_kind) == check.checksum
    h = xxhash.xxh3_64(check.meta)
    for offset, pos, step in blocks(extents):
        block = dst[pos : pos + step]
        block[:] = arena[offset : offset + step]
        h.update(block)
    return int(h.intdigest()) == check.checksum


Digest = Callable[[], tuple[int, int]]
"""A write's (checksum, kind), asked for once its window's copies completed."""
Check = Callable[[], bool]
"""Whether a read's copy holds the chunk, asked for once its window's copies completed."""


class Copies(ABC):
    """The copy step of a batch window: how chunk bytes move between the window's lease
    extents and the caller's buffers or tensors. The window around it (the requests, the
    replies, the per-key results, when leases end) is one loop, `putwindows.write_windows`
    and `read_window`, whatever moves the bytes."""

    dma = False
    """The copies run on a device and may outlive this process's connection (a GPU's
    DMA): the window's ALLOCs and ACQUIREs say so, and the agent drains the leases of a
    connection that closes with them (docs/protocol.md, "Leases")."""

    @abstractmethod
    def write(self, index: int, lease: p.AllocReply) -> Digest:
        """Start copying the window's chunk `index` into the write lease's extents."""

    @abstractmethod
    def read(self, index: int, lease: p.AcquireReply, out: Any) -> Check:
        """Start copying a read lease's chunk into `out`, what the caller's target gave
        for the key at `index` of its call."""

    def queue(self) -> None:
        """Hand the copies started so far to the device now (a device's copies may wait
        to be queued together): the read window calls it after each group."""
        return None

    def fence(self) -> None:
        """Wait until every copy started so far completed (CPU copies complete as they
        are made): leases end only after it."""
        return None

    def settle(self) -> None:
        """The same on a failing path, whose own error is the one to report: a lease
        is not ended while a copy may still use its pages."""
        return None


class WindowConnection(Protocol):
    """What a batch window needs of the connection to the agent."""

    def rid(self) -> int: ...

    def exchange(self, reqs: Sequence[p.Request]) -> list[p.Reply]: ...

    def post(self, reqs: Sequence[p.Request], casts: Sequence[p.Request] = ()) -> None: ...

    def replies(self, n: int) -> list[p.Reply]: ...

    def answered(self) -> bool: ...

    def cast(self, *reqs: p.Request) -> None: ...

    def close(self) -> None: ...


def read_window(conn: WindowConnection, copies: Copies, keys: Sequence[bytes], start: int,
                target: ReadTarget, sizes: list[int], meanwhile: Meanwhile = None) -> None:
    """ACQUIRE the window's chunks, copy each granted one into what `target` gives, wait
    for the copies, then RELEASE the leases (not waited for): a read lease ends only after
    the copies that read it completed.

    Copies made by this process's CPU go in groups (`read_groups`): the next group's
    ACQUIREs go out before this group is copied, so the agent answers them meanwhile, and
    a group's RELEASEs go out with the ACQUIREs of the group after the next. A device's
    copies (`copies.dma`) go in the same groups, each queued to the device as soon as it
    is planned, with one fence for the window (`_device_read_window`).

    Within a group, the replies in hand are copied whenever the next one has not arrived
    yet (`conn.answered`): a chunk the agent is still reading from below (a peer, NVMe)
    is waited for with the chunks before it copied, not after (all replies there at once,
    the group is read whole, then the next group posted, then copied, as above)."""
    if copies.dma:
        _device_read_window(conn, copies, keys, start, target, sizes, meanwhile)
        return
    groups = read_groups(len(keys))
    conn.post(_acquires(conn, keys, groups[0], dma=False))
    unread = groups[0][1] - groups[0][0]
    """Replies to ACQUIREs sent and not read yet."""
    releases: list[p.Request] = []
    """Granted leases whose RELEASE has not gone out."""
    granted: list[p.Request] = []
    """This group's granted leases, not in `releases` yet."""
    try:
        if meanwhile is not None:
            meanwhile()
        for n, (lo, hi) in enumerate(groups):
            group = _GroupCopies(copies, start + lo, target, sizes)
            try:
                replies: list[p.Reply] = []
                while len(replies) < hi - lo:
                    if replies and not copies.dma and not conn.answered():
                        group.start(replies)  # while the agent works on the next one
                    reply = conn.replies(1)[0]
                    unread -= 1
                    replies.append(reply)
                    if isinstance(reply, p.AcquireReply):
                        granted.append(p.Release(conn.rid(), reply.lease))
                if n + 1 < len(groups):
                    conn.post(_acquires(conn, keys, groups[n + 1], dma=False), casts=releases)
                    unread += groups[n + 1][1] - groups[n + 1][0]
                    releases = []
                releases += granted
                granted = []
                group.start(replies)
                group.finish()
            finally:
                group.settle()
    finally:
        _end_window(conn, releases + granted, unread)


def _device_read_window(conn: WindowConnection, copies: Copies, keys: Sequence[bytes],
                        start: int, target: ReadTarget, sizes: list[int],
                        meanwhile: Meanwhile) -> None:
    """`read_window` for a device's copies: the ACQUIREs go in the same groups, the next
    group's out before this group's copies are planned, and each group's copies are
    queued (`Copies.queue`) once planned, so the agent answers the next group while the
    device copies this one (not all ACQUIREs answered before the first DMA). One fence
    for the window, at its end: a device's fence is a wait for the device, and the
    copies of a group need not have completed before the next group's are queued. Every
    lease is RELEASEd after that fence."""
    groups = read_groups(len(keys))
    conn.post(_acquires(conn, keys, groups[0], dma=True))
    unread = groups[0][1] - groups[0][0]
    """Replies to ACQUIREs sent and not read yet."""
    releases: list[p.Request] = []
    """Granted leases: RELEASEd once the window's copies completed (or on failure, once no
    copy that started may still use their pages)."""
    window = _GroupCopies(copies, start, target, sizes)
    replies: list[p.Reply] = []
    try:
        if meanwhile is not None:
            meanwhile()
        try:
            for n, (_, hi) in enumerate(groups):
                while len(replies) < hi:
                    reply = conn.replies(1)[0]
                    unread -= 1
                    replies.append(reply)
                    if isinstance(reply, p.AcquireReply):
                        releases.append(p.Release(conn.rid(), reply.lease))
                if n + 1 < len(groups):
                    conn.post(_acquires(conn, keys, groups[n + 1], dma=True))
                    unread += groups[n + 1][1] - groups[n + 1][0]
                window.start(replies)
                copies.queue()
            window.finish()
        finally:
            window.settle()
    finally:
        _end_window(conn, releases, unread)


def _acquires(conn: WindowConnection, keys: Sequence[bytes], group: tuple[int, int],
              dma: bool) -> list[p.Request]:
    """The ACQUIREs of a read window's group of keys (`dma`: the copies are a device's)."""
    return [p.Acquire(conn.rid(), k, dma) for k in keys[group[0] : group[1]]]


def _end_window(conn: WindowConnection, releases: list[p.Request], unread: int) -> None:
    """A read window's RELEASEs, once no copy may still use their pages; after a failure
    with `unread` ACQUIREs not answered yet, their leases' too."""
    if unread:
        try:
            releases = releases + [p.Release(conn.rid(), r.lease)
                                   for r in conn.replies(unread)
                                   if isinstance(r, p.AcquireReply)]
        except (OSError, p.ProtocolError):
            conn.close()  # the agent ends a closed connection's leases itself
    conn.cast(*releases)


READ_GROUP_FIRST = 4
"""Keys in a pipelined read window's first group (its round trip is the one no copy hides)."""
READ_GROUP_GROWTH = 4
"""How many times larger each next group is: its ACQUIREs, answered while the group before
is copied, take the agent ~20 µs a key against ~0.4 ms to copy a 4 MiB chunk, so a
group four times larger is still answered in time; each group costs a write, which wakes
the agent (on a loaded machine, often onto this thread's core) and lets the GIL go. A
window of 63 keys is 2 groups (4 and 59: 26.0 ms against 29.1 ms for 5 groups doubling
from 2), one of 7 keys one group (docs/benchmarks.md, "vLLM's time to first token")."""


def read_groups(n: int) -> list[tuple[int, int]]:
    """The [lo, hi) key ranges of a read window of `n` keys, in order."""
    if n <= READ_GROUP_FIRST:
        return [(0, n)]
    groups, lo, size = [], 0, READ_GROUP_FIRST
    while lo < n:
        hi = n if n - lo < READ_GROUP_GROWTH * size + size // 2 else lo + size  # no small last
        groups.append((lo, hi))
        lo, size = hi, size * READ_GROUP_GROWTH
    return groups


class _GroupCopies:
    """The copies of one group of a read window: started as its replies come (`start`,
    given the group's replies so far), then waited for (`finish`): the sizes of those that
    passed their check recorded. `settle` on every path: no lease ends while a copy that
    started may still use its pages."""

    def __init__(self, copies: Copies, start: int, target: ReadTarget,
                 sizes: list[int]) -> None:
        self.copies, self.at, self.target, self.sizes = copies, start, target, sizes
        self.taken = 0
        """Replies handed to `copies` so far."""
        self.started: list[tuple[int, p.AcquireReply]] = []
        self.checks: list[Check] = []
        self.fenced = False

    def start(self, replies: Sequence[p.Reply]) -> None:
        """Start the copies of the granted chunks among `replies[self.taken:]` (`replies`
        answer the group's keys in order)."""
        first, self.taken = self.taken, len(replies)
        for i, reply, out in acquired(replies[first:], self.at + first, self.target):
            self.started.append((first + i, reply))  # before its copies: settled on failure
            self.checks.append(self.copies.read(self.at + first + i, reply, out))

    def finish(self) -> None:
        self.copies.fence()
        self.fenced = True
        for (i, reply), check in zip(self.started, self.checks, strict=True):
            if check():
                self.sizes[self.at + i] = reply.size

    def settle(self) -> None:
        if self.started and not self.fenced:
            self.copies.settle()


class BufferCopies(Copies):
    """Copies between the mapped arena and buffers, made by the CPU as they are asked for;
    a write's checksum (XXH3) is computed block by block as it is copied, a read's
    verified the same way unless `verify` is False. Reads into `HostRanges` are made
    together at the fence, in one native call (`kvpool.agent.hostcopy`); `base` is the
    arena mapping's address. Reads of chunks into buffers go to the process's copy
    threads where it has them (`copythreads`), each chunk a job, waited for at the
    fence."""

    def __init__(self, arena: memoryview, sources: Sequence[memoryview] = (),
                 metas: Sequence[bytes] = (), verify: bool = True, base: int = 0) -> None:
        self.arena = arena
        self.sources = sources
        self.metas = metas
        self.verify = verify
        self.base = base
        self._host: HostReads | None = None
        self._jobs: list[Future[bool]] = []
        """Copies on the copy threads not waited for yet."""

    def write(self, index: int, lease: p.AllocReply) -> Digest:
        digest = copy_and_checksum(self.arena, lease.extents, self.sources[index],
                                   self.metas[index])
        return lambda: (digest, checksums.XXH3)

    def read(self, index: int, lease: p.AcquireReply, out: Any) -> Check:
        if isinstance(out, HostRanges):
            if self._host is None:
                if not self.base:
                    raise ValueError("reads into host ranges need the arena's address")
                self._host = HostReads(self.arena, self.base, self.verify)
            return self._host.add(lease, out)
        dst = fits(as_bytes_view(out), lease.size)
        check = lease if self.verify else None
        job = copythreads.start(self.arena, self.base, lease.extents, dst, check)
        if job is not None:
            self._jobs.append(job)
            return job.result  # asked for after the fence: done by then
        intact = copy_out(self.arena, lease.extents, dst, check)
        return lambda: intact

    def fence(self) -> None:
        self._wait()
        if self._host is not None:
            self._host.run()

    def settle(self) -> None:
        self._wait()

    def _wait(self) -> None:
        """Every copy thread's job of this window done (failed ones too: their error is
        the check's to raise)."""
        jobs, self._jobs = self._jobs, []
        if jobs:
            futures.wait(jobs)


class Connection:
    """One socket to the agent: framing, request ids, and the replies still owed to
    fire-and-forget requests (RELEASE, ABORT), which are read before the next call's."""

    def __init__(self, sock: socket.socket, rids: Iterator[int]) -> None:
        self.sock: socket.socket | None = sock
        self._rids = rids
        self._unanswered = 0
        self._rbuf = bytearray(64 * 1024)
        self._ahead = memoryview(bytearray(_READ_AHEAD))
        self._early = bytearray()
        """Bytes `_collect` read past the last whole reply: the start of the next one."""
        self._told: list[bytes | p.Request] = []
        """Told requests not sent yet, encoded or not (encoded when written: a caller that
        holds them, `held_casts`, pays for it after its block): they go first in the next
        write."""
        self._holding = 0
        """Open `held_casts` blocks: casts wait in `_told` until the outermost one ends."""
        self._held_casts = HeldCasts(self)
        self._reads: list[bytes] = []
        """Keys read without a lease in a `held_casts` block, not told yet (`tell_reads`)."""
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)
        self.untold = 0
        """Requests `tell` dropped because the agent was behind."""
        self._torn = False
        """A write failed: the stream to the agent may end mid-frame, so `close` writes
        nothing more on it."""

    @property
    def closed(self) -> bool:
        return self.sock is None

    def rid(self) -> int:
        return next(self._rids)

    def close(self) -> None:
        """Close the socket. What was told and not written yet goes first, not waited for
        (a client's last reads without a lease are still its reads: the eviction order, the
        tier's read bytes, a hand-off's pin, which would otherwise wait for its TTL); a
        socket that fails at it (the agent gone) is closed all the same. Never waits: an
        agent that stopped reading (its socket buffer full) does not hold a close up; what
        the buffer does not take is dropped, as a client that died would drop it."""
        sock = self.sock
        if sock is None:
            return
        if self._reads:
            keys, self._reads = self._reads, []
            self._told.append(p.Read(self.rid(), keys))
        if self._told and not self._torn:
            with contextlib.suppress(OSError):
                sock.send(self._take_told(), socket.MSG_DONTWAIT)
        sock.close()
        self.sock = None

    def _live(self) -> socket.socket:
        if self.sock is None:
            raise ConnectionError("connection to the agent was dropped")
        return self.sock

    def _recv_exact(self, n: int) -> memoryview:
        sock = self._live()
        # Small frames (control replies) are read ahead: one recv takes every reply that
        # has arrived, not two per reply. A blocking call lets the GIL go, and a thread
        # sharing it with a busy one (an engine's loop) may wait a switch interval to get
        # it back.
        while n <= _READ_AHEAD and len(self._early) < n:
            r = sock.recv_into(self._ahead, _READ_AHEAD)
            if r == 0:
                raise ConnectionError("agent closed the connection")
            self._early += self._ahead[:r]
        if len(self._rbuf) < n:
            self._rbuf = bytearray(n)
        view = memoryview(self._rbuf)[:n]
        got = min(n, len(self._early))
        if got:
            view[:got] = self._early[:got]
            del self._early[:got]
        while got < n:
            r = sock.recv_into(view[got:], n - got)
            if r == 0:
                raise ConnectionError("agent closed the connection")
            got += r
        return view

    def _read_reply(self) -> p.Reply:
        (length,) = p.HEADER.unpack(self._recv_exact(p.HEADER.size))
        reply: p.Reply = p.reply_decoder.decode(self._recv_exact(length))
        return reply

    def _drain(self) -> None:
        while self._unanswered:
            # Replies to fire-and-forget RELEASEs/ABORTs come first; a failed
            # release only means the lease was already gone, so they are skipped unread.
            self._unanswered -= 1
            (length,) = p.HEADER.unpack(self._recv_exact(p.HEADER.size))
            self._recv_exact(length)

    def _send(self, frames: bytes) -> None:
        """Write the told requests waiting, then `frames`, in one write."""
        sock = self._live()
        if self._told:
            self._unanswered += len(self._told)
            frames = self._take_told() + frames
        try:
            sock.sendall(frames)
        except BaseException:
            self._torn = True  # (a timeout may have left a frame half written)
            raise

    def _take_told(self) -> bytes:
        """The told requests waiting, encoded and joined in their order, taken out."""
        frames = b"".join([r if isinstance(r, bytes) else p.encode(r) for r in self._told])
        self._told.clear()
        return frames

    def _collect(self) -> None:
        """Drop the owed replies that have arrived whole, never waiting for one. With no
        call in flight every byte the agent sent is an owed reply (nobody reads them)."""
        sock = self.sock
        while self._unanswered and sock is not None and self._readable.poll(0):
            data = sock.recv(1 << 16)  # readable: returns at once
            if not data:
                self.close()  # the agent closed: the next call reconnects
                return
            self._early += data
            while self._unanswered and len(self._early) >= p.HEADER.size:
                whole = p.HEADER.size + p.HEADER.unpack_from(self._early)[0]
                if len(self._early) < whole:
                    break
                del self._early[:whole]
                self._unanswered -= 1

    def hung_up(self) -> bool:
        """Whether the agent closed this connection (it died or restarted), found without
        waiting: the owed replies already in are taken on the way. Nothing owed, the socket
        can be readable only at its end."""
        try:
            self._collect()
            sock = self.sock
            if sock is None:
                return True
            if self._unanswered or not self._readable.poll(0):
                return False
            if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                return False  # bytes nobody asked for: the next call's read says what
        except BlockingIOError:
            return False
        except OSError:
            pass  # reset: as closed
        self.close()
        return True

    def tell(self, req: p.Request, now: bool = False) -> None:
        """Let the agent know `req` without waiting for it: it goes with the next call (or
        with `TELL_BATCH` others; `now`: in a write of its own at once), its reply read
        and dropped like a cast's. When `TELL_AHEAD` replies are outstanding the agent is
        behind, and `req` is dropped (counted in `untold`) rather than make this client
        wait for it."""
        if self.sock is None:
            return
        try:
            if self._unanswered + len(self._told) >= TELL_AHEAD:
                self._collect()
                if self._unanswered + len(self._told) >= TELL_AHEAD:
                    self.untold += 1
                    return
            self._told.append(req)
            if now or len(self._told) >= TELL_BATCH:
                self._send(b"")
        except OSError:
            self.close()  # the next call reconnects

    def tell_reads(self, keys: list[bytes]) -> None:
        """Tell the agent of chunks read without a lease (a READ, `tell`): in a
        `held_casts` block, one READ when it ends (as its RELEASEs: the caller hands the
        read's data on first), else now."""
        if self._holding:
            self._reads += keys
        else:
            self.tell(p.Read(self.rid(), keys))

    def call(self, req: p.Request) -> p.Reply:
        """Send `req` and return its reply; an error reply raises `ProtocolError`."""
        self._send(p.encode(req))
        self._drain()
        reply = self._read_reply()
        if isinstance(reply, p.ErrorReply):
            raise p.ProtocolError(reply.code, reply.message)
        return reply

    def exchange(self, reqs: Sequence[p.Request]) -> list[p.Reply]:
        """Send `reqs` in one write; their replies, error replies included, in order."""
        if not reqs:
            return []
        self.post(reqs)
        return self.replies(len(reqs))

    def post(self, reqs: Sequence[p.Request], casts: Sequence[p.Request] = ()) -> None:
        """Send `casts` (not waited for, like `cast`'s) then `reqs` in one write; read
        `reqs`' replies with `replies` before any other call."""
        self._send(b"".join(p.encode(r) for r in (*casts, *reqs)))
        self._unanswered += len(casts)

    def replies(self, n: int) -> list[p.Reply]:
        """The replies, error replies included, of the `n` requests `post` sent."""
        self._drain()
        return [self._read_reply() for _ in range(n)]

    def answered(self) -> bool:
        """Whether bytes of a reply have arrived and wait to be read (reading the next
        reply would not wait for the agent to answer, but at most for the rest of a frame
        it is writing)."""
        if self._early:
            return True
        return self.sock is not None and bool(self._readable.poll(0))

    def cast(self, *reqs: p.Request) -> None:
        """Send without waiting; the replies are read before the next call's. Inside
        `held_casts` they go with the next write or at the block's end."""
        if not reqs or self.sock is None:
            return
        if self._holding:
            self._told += reqs
            return
        try:
            self._send(b"".join(p.encode(r) for r in reqs))
        except OSError:
            # The agent drops a closed connection's leases itself; the next call
            # reconnects. Raising here would redo work already handed out.
            self.close()
            return
        self._unanswered += len(reqs)

    def held_casts(self) -> HeldCasts:
        """Hold back the casts made in the block (a read's RELEASEs) until it ends, then
        send them in one write (any call made meanwhile takes them along first). A caller
        that hands a read's data on before its leases end is not kept waiting by that
        write: it wakes the agent, which on a busy machine may take this thread's core."""
        return self._held_casts  # (one for the connection: it holds no state of a block)

    def _held(self, delta: int) -> None:
        self._holding += delta
        if self._holding:
            return
        if self._reads:
            keys, self._reads = self._reads, []
            self.tell(p.Read(self.rid(), keys))
        if self._told and self.sock is not None:
            try:
                self._send(b"")
            except OSError:
                self.close()  # the agent ends a closed connection's leases itself


class HeldCasts:
    """`Connection.held_casts`'s block (a class, not a generator: it is entered on every
    load of an engine's connector, where each Python step counts)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def __enter__(self) -> None:
        self._conn._holding += 1  # (`_held(1)`, one Python call fewer)

    def __exit__(self, *exc: object) -> None:
        self._conn._held(-1)


class Transport(ABC):
    """What moves chunk bytes over one connection. The batch methods work on one
    window (at most `window()` keys), writing into `sizes`/`results` from `start` on;
    the client splits a batch into windows and retries a window after a reconnect."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    @abstractmethod
    def window(self, batch_window: int, max_leases: int) -> int:
        """How many keys one window of a batch call holds."""

    @abstractmethod
    def put(self, key: bytes, src: memoryview, meta: bytes,
            blocks: p.EngineBlocks | None = None, to: str = "") -> bool: ...

    @abstractmethod
    def get(self, key: bytes, verify: bool) -> tuple[bytes, bytes] | None: ...

    @abstractmethod
    def get_into(self, key: bytes, dst: memoryview, verify: bool) -> int: ...

    @abstractmethod
    def get_window(self, keys: Sequence[bytes], start: int, target: ReadTarget,
                   sizes: list[int], verify: bool, meanwhile: Meanwhile = None) -> None: ...

    @abstractmethod
    def put_windows(self, call: PutCall, views: Sequence[memoryview], batch_window: int,
                    max_leases: int) -> None:
        """Put the call's chunks (`views`, a buffer a key) from `call.done` on, a window
        (`window()` keys) at a time; `call.done` says how far it got if it fails."""

    def close(self) -> None:
        self.conn.close()


class InlineTransport(Transport):
    """Chunk bytes inside PUT/GET frames; batches go key by key."""

    def window(self, batch_window: int, max_leases: int) -> int:
        return 1  # one key per retried unit, as a plain put/get

    def put(self, key: bytes, src: memoryview, meta: bytes,
            blocks: p.EngineBlocks | None = None, to: str = "") -> bool:
        digest = p.checksum(src, meta)
        reply = self.conn.call(p.with_blocks(p.Put(self.conn.rid(), key, bytes(src), digest,
                                                   meta, to=to), blocks))
        assert isinstance(reply, p.PutReply)
        return reply.stored

    def get(self, key: bytes, verify: bool) -> tuple[bytes, bytes] | None:
        try:
            reply = self.conn.call(p.Get(self.conn.rid(), key))
        except p.ProtocolError as e:
            if e.code == p.ErrorCode.NOT_FOUND:
                return None
            raise
        assert isinstance(reply, p.GetReply)
        if verify and p.checksum(reply.data, reply.meta, reply.checksum_kind) != reply.checksum:
            return None
        return reply.data, reply.meta

    def get_into(self, key: bytes, dst: memoryview, verify: bool) -> int:
        got = self.get(key, verify)
        if got is None:
            return 0
        data = got[0]
        fits(dst, len(data))[: len(data)] = data
        return len(data)

    def get_window(self, keys: Sequence[bytes], start: int, target: ReadTarget,
                   sizes: list[int], verify: bool, meanwhile: Meanwhile = None) -> None:
        if meanwhile is not None:
            meanwhile()
        for i, key in enumerate(keys):
            got = self.get(key, verify)
            out = None if got is None else target(start + i, len(got[0]), got[1])
            if got is not None and out is not None:
                if isinstance(out, HostRanges):
                    scatter(got[0], out)
                else:
                    dst = fits(as_bytes_view(out), len(got[0]))
                    dst[: len(got[0])] = got[0]
                sizes[start + i] = len(got[0])

    def put_windows(self, call: PutCall, views: Sequence[memoryview], batch_window: int,
                    max_leases: int) -> None:
        for i in range(call.done, len(call.keys)):
            try:
                call.results[i] = self.put(call.keys[i], views[i], call.metas[i],
                                           call.blocks[i] if call.blocks is not None else None,
                                           call.to)
            except p.ProtocolError as e:
                call.results[i] = e
            call.done = i + 1


class ZeroCopyTransport(Transport):
    """Chunk bytes through the agent's mapped DRAM arena; a batch window costs one
    round trip to read (ACQUIREs in one write) and two to write (ALLOCs, COMMITs)."""

    def __init__(self, conn: Connection, arena_fd: int, arena_bytes: int,
                 index_fd: int | None = None) -> None:
        super().__init__(conn)
        self.index: IndexReader | None = None
        """The agent's DRAM keys, mapped read-only (lookupindex.py), when it sent them."""
        if index_fd is not None and IndexReader.usable():
            try:
                self.index = IndexReader(index_fd)
            except (OSError, ValueError):
                self.index = None  # LOOKUP goes over the socket, as with an older agent
        # MAP_POPULATE: fault the whole arena in now, not on first copy.
        self._mm = mmap.mmap(arena_fd, arena_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self.arena = memoryview(self._mm)
        self.base = address_of(self._mm)
        """The mapping's address, for reads into host ranges (`kvpool.agent.hostcopy`)."""
        self.device: Any = None
        """The mapping as tensors see it (`kvpool.agent.gpu.DeviceArena`), made by the
        client at the first tensor: registered with CUDA once per mapping."""
        self.put_ahead = False
        """Each put's COMMIT asks for the next put's lease of its size (put-ahead)."""
        self.spares: dict[int, tuple[int, p.Extents]] = {}
        """Chunk size -> a spare write lease for it (id, extents), oldest first: the next
        put of that size copies into it and COMMITs, with no ALLOC round trip."""

    def close(self) -> None:
        super().close()
        if self.device is not None:  # unregistered before it is unmapped
            self.device.close()
            self.device = None
        self.arena.release()
        self._mm.close()
        if self.index is not None:
            self.index.close()
            self.index = None

    def window(self, batch_window: int, max_leases: int) -> int:
        # Never hold more leases at once than the agent grants one connection.
        return max(1, min(batch_window, max_leases - len(self.spares)))

    def _acquire(self, key: bytes) -> p.AcquireReply | None:
        try:
            reply = self.conn.call(p.Acquire(self.conn.rid(), key))
        except p.ProtocolError as e:
            if e.code == p.ErrorCode.NOT_FOUND:
                return None
            raise
        assert isinstance(reply, p.AcquireReply)
        return reply

    def put(self, key: bytes, src: memoryview, meta: bytes,
            blocks: p.EngineBlocks | None = None, to: str = "") -> bool:
        spare = self.spares.pop(src.nbytes, None)
        if spare is not None:
            try:
                # The key and metadata ride on the COMMIT; a duplicate is learnt there.
                return self._write(spare, src, meta, blocks, to, key)
            except p.ProtocolError as e:
                if e.code != p.ErrorCode.UNKNOWN_LEASE:
                    raise
                # The spare is gone (never, unless the agent dropped it): put as before.
        alloc = self.conn.call(p.Alloc(self.conn.rid(), key, src.nbytes, meta, to=to))
        assert isinstance(alloc, p.AllocReply)
        if alloc.exists:
            return False
        return self._write((alloc.lease, alloc.extents), src, meta, blocks, to)

    def _write(self, lease: tuple[int, p.Extents], src: memoryview, meta: bytes,
               blocks: p.EngineBlocks | None, to: str, key: bytes = b"") -> bool:
        """Copy `src` into a write lease's extents and COMMIT it (naming `key` and `meta`
        for a spare); whether it was stored. With put-ahead the COMMIT also asks for the
        next put's lease of this size, kept in `spares`."""
        lease_id, extents = lease
        try:
            digest = copy_and_checksum(self.arena, extents, src, meta)
        except BaseException:
            self.conn.cast(p.Abort(self.conn.rid(), lease_id))
            raise
        size = src.nbytes if self.put_ahead else 0
        if size and size not in self.spares and len(self.spares) >= p.MAX_SPARE_LEASES:
            oldest = next(iter(self.spares))  # room for this size's: the oldest size goes
            self.conn.cast(p.Abort(self.conn.rid(), self.spares.pop(oldest)[0]))
        commit = p.Commit(self.conn.rid(), lease_id, digest, next_size=size, key=key,
                          meta=meta if key else b"", to=to)
        try:
            reply = self.conn.call(p.with_blocks(commit, blocks))
        except p.ProtocolError as e:
            if key and e.code != p.ErrorCode.UNKNOWN_LEASE:  # a refused spare stays open
                self.conn.cast(p.Abort(self.conn.rid(), lease_id))
            raise
        assert isinstance(reply, p.CommitReply)
        if reply.spare:
            self.spares[size] = (reply.spare, reply.spare_extents)
        return reply.stored

    def get(self, key: bytes, verify: bool) -> tuple[bytes, bytes] | None:
        lease = self._acquire(key)
        if lease is None:
            return None
        try:
            arena = self.arena
            data = b"".join(arena[o : o + n] for o, n in lease.extents) \
                if len(lease.extents) > 1 else bytes(
                    arena[lease.extents[0][0] : lease.extents[0][0] + lease.size])
        finally:
            self.conn.cast(p.Release(self.conn.rid(), lease.lease))
        if verify and p.checksum(data, lease.meta, lease.checksum_kind) != lease.checksum:
            return None
        return data, lease.meta

    def get_into(self, key: bytes, dst: memoryview, verify: bool) -> int:
        lease = self._acquire(key)
        if lease is None:
            return 0
        try:
            intact = copy_out(self.arena, lease.extents, fits(dst, lease.size),
                              lease if verify else None)
        finally:
            self.conn.cast(p.Release(self.conn.rid(), lease.lease))
        return lease.size if intact else 0

    def get_window(self, keys: Sequence[bytes], start: int, target: ReadTarget,
                   sizes: list[int], verify: bool, meanwhile: Meanwhile = None) -> None:
        read_window(self.conn, BufferCopies(self.arena, verify=verify, base=self.base), keys,
                    start, target, sizes, meanwhile)

    def put_windows(self, call: PutCall, views: Sequence[memoryview], batch_window: int,
                    max_leases: int) -> None:
        self.write_windows(call, lambda lo, hi: BufferCopies(self.arena, views[lo:hi],
                                                             call.metas[lo:hi]),
                           batch_window, max_leases)

    def write_windows(self, call: PutCall, copies_of: CopiesOf, batch_window: int,
                      max_leases: int) -> None:
        """`put_windows` with the copy step `copies_of` gives each window (buffers' or
        tensors': `kvpool.agent.gpu`), pipelined (`kvpool.agent.putwindows`)."""
        # Spares count against the connection's uncommitted bytes: the windows get the
        # budget they had without put-ahead.
        self.conn.cast(*[p.Abort(self.conn.rid(), lease) for lease, _ in self.spares.values()])
        self.spares.clear()
        write_windows(self.conn, call, copies_of, self.window(batch_window, max_leases),
                      self.arena.nbytes, max_leases)


def connect(path: str, mode: Mode, hello: p.Hello, timeout: float,
            rids: Iterator[int]) -> tuple[Transport, p.HelloReply]:
    """Open a connection, say HELLO, and build the transport `mode` asks for."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    fds: list[int] = []
    try:
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            # The kernel's error names no path: the socket's, as open() names its file.
            raise type(e)(e.errno, e.strerror, path) from None
        # An agent refusing the connection (over its space's share) answers and closes
        # without reading HELLO: its reply is still there to read, and says why.
        with contextlib.suppress(BrokenPipeError):
            sock.sendall(p.encode(hello))
        # The arena's fd, then the lookup index's (an older agent sends the first only).
        msg, fds, _, _ = socket.recv_fds(sock, _HELLO_RECV, 2)
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
            raise p.ProtocolError(reply.code, reply.message)
        assert isinstance(reply, p.HelloReply)
        conn = Connection(sock, rids)
        transport: Transport
        if mode == "inline":
            transport = InlineTransport(conn)
        elif fds:
            transport = ZeroCopyTransport(conn, fds[0], reply.arena_bytes,
                                          fds[1] if len(fds) > 1 else None)
        else:
            raise ConnectionError("agent sent no arena fd with its HELLO reply")
    except BaseException:
        sock.close()
        raise
    finally:
        for fd in fds:
            os.close(fd)
    return transport, reply
