"""A batch of FETCH replies sent in one compiled call that never takes the GIL: for each
reply its head (`send`, flagged `MSG_MORE` where bytes follow, so it leaves in one segment
with them) then its chunk's byte ranges (`sendfile` from the arena or the chunk's file;
`send` from the arena's mapping, a copy, where the reader shares this kernel),
on the connection's non-blocking socket, each wait for room a `poll` bounded by the
reply's deadline and ended early by a stop eventfd.

Why: on the event loop each reply cost the holding agent's Python a head `send` through
ctypes, one or more `sendfile` calls, a writer callback and a future whenever the socket's
buffer was full, and the loop's wake-ups for each (docs/benchmarks.md, "The peer tier
between two nodes"). A reader asks for up to 32 chunks in one write; the holder now reads
every FETCH of such a batch already in its buffer, takes their sources and leases on the
loop, and hands the whole batch to a worker thread in one call: one hand-off each way per
batch, none per chunk.

`sendbatch(ctx, fns) -> code` (LLVM IR compiled by llvmlite, as `recvkernel`). `fns`:
libc's `send`, `sendfile`, `poll`, `clock_gettime`, `__errno_location`. `ctx` (i64
slots below): the socket, the stop eventfd (-1: none), the items and their count, the
bound per reply in ns, the clock; the call answers how many replies went out whole,
whether any byte of the next one went (`PARTIAL`), and errno. An item is six i64: the
head's address and length, the file's descriptor, its ranges' address (pairs of offset,
length; with a negative descriptor, of address and length in this process's memory) and
count, and (written by the call) the clock's ns when its last byte was handed to the
socket. Codes:

- DONE: every reply went out.
- TIMEOUT: a reply took longer than the bound (a reader that stopped reading).
- STOPPED: the stop eventfd became readable while the call waited for room.
- ERRNO: a system call failed (`errno`: the connection reset, ...).
- ENDED: a file ended before its range (a chunk file cut under the read).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import select
import socket
import struct
import sys
import time
from collections.abc import Callable

from ..jit import Lazy, compile_ir

log = logging.getLogger(__name__)

DONE, TIMEOUT, STOPPED, ERRNO, ENDED = range(5)

# ctx slots (i64): set by the caller...
_FD, _STOP, _ITEMS, _NITEMS, _BOUND, _CLOCK = range(6)
# ...and by the call
_DONE, _PARTIAL, _ERRNO = range(6, 9)
CTX_SLOTS = 10
ITEM = 6
"""i64 slots per item: head address, head length, file fd (negative: the ranges are in
memory), ranges address, range count, end (ns, written by the call)."""
_FNS = ("send", "sendfile", "poll", "clock_gettime", "__errno_location")

_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL

_IR = f"""
define internal i64 @now(ptr %fns, i32 %clock, ptr %ts) {{
entry:
  %cgp = getelementptr ptr, ptr %fns, i64 3
  %gettime = load ptr, ptr %cgp, align 8
  %cr = call i32 %gettime(i32 %clock, ptr %ts)
  %sec = load i64, ptr %ts, align 8
  %tsn = getelementptr i64, ptr %ts, i64 1
  %nsec = load i64, ptr %tsn, align 8
  %sns = mul i64 %sec, 1000000000
  %t = add i64 %sns, %nsec
  ret i64 %t
}}

; libc's errno of the thread.
define internal i32 @errno_now(ptr %fns) {{
entry:
  %elp = getelementptr ptr, ptr %fns, i64 4
  %errno_at = load ptr, ptr %elp, align 8
  %ep = call ptr %errno_at()
  %e = load i32, ptr %ep, align 4
  ret i32 %e
}}

; A call failed with errno `e`: kept in ctx for the caller, and the code to end with.
define internal i64 @failed_with(ptr %ctx, i32 %e) {{
entry:
  %e64 = sext i32 %e to i64
  %erp = getelementptr i64, ptr %ctx, i64 {_ERRNO}
  store i64 %e64, ptr %erp, align 8
  ret i64 {ERRNO}
}}

; After a send or sendfile that did not move bytes (r <= 0): 0 to try again (EINTR, or
; room came within the deadline), else the code to end with.
define internal i64 @trouble(ptr %ctx, ptr %fns, i64 %r, i64 %deadline, ptr %ts, ptr %pfd) {{
entry:
  %neg = icmp slt i64 %r, 0
  br i1 %neg, label %errno, label %wait
errno:
  %e = call i32 @errno_now(ptr %fns)
  %eintr = icmp eq i32 %e, {errno.EINTR}
  br i1 %eintr, label %again, label %other
other:
  %eagain = icmp eq i32 %e, {errno.EAGAIN}
  br i1 %eagain, label %wait, label %failed
failed:
  %fr = call i64 @failed_with(ptr %ctx, i32 %e)
  ret i64 %fr
wait:
  %clp = getelementptr i64, ptr %ctx, i64 {_CLOCK}
  %cl64 = load i64, ptr %clp, align 8
  %clock = trunc i64 %cl64 to i32
  %t = call i64 @now(ptr %fns, i32 %clock, ptr %ts)
  %left = sub i64 %deadline, %t
  %over = icmp sle i64 %left, 0
  br i1 %over, label %timeout, label %poll
poll:
  %fd64 = load i64, ptr %ctx, align 8
  %fd = trunc i64 %fd64 to i32
  %stp = getelementptr i64, ptr %ctx, i64 {_STOP}
  %st64 = load i64, ptr %stp, align 8
  %st = trunc i64 %st64 to i32
  store i32 %fd, ptr %pfd, align 4
  %ev0 = getelementptr i8, ptr %pfd, i64 4
  store i16 {select.POLLOUT}, ptr %ev0, align 2
  %rv0 = getelementptr i8, ptr %pfd, i64 6
  store i16 0, ptr %rv0, align 2
  %fd1 = getelementptr i8, ptr %pfd, i64 8
  store i32 %st, ptr %fd1, align 4
  %ev1 = getelementptr i8, ptr %pfd, i64 12
  store i16 {select.POLLIN}, ptr %ev1, align 2
  %rv1 = getelementptr i8, ptr %pfd, i64 14
  store i16 0, ptr %rv1, align 2
  %ms0 = sdiv i64 %left, 1000000
  %ms = add i64 %ms0, 1
  %ms32 = trunc i64 %ms to i32
  %plp = getelementptr ptr, ptr %fns, i64 2
  %pollf = load ptr, ptr %plp, align 8
  %pr = call i32 %pollf(ptr %pfd, i64 2, i32 %ms32)
  %pfail = icmp slt i32 %pr, 0
  br i1 %pfail, label %pollerr, label %polled
pollerr:
  %e2 = call i32 @errno_now(ptr %fns)
  %eintr2 = icmp eq i32 %e2, {errno.EINTR}
  br i1 %eintr2, label %again, label %pollfailed
pollfailed:
  %pfr = call i64 @failed_with(ptr %ctx, i32 %e2)
  ret i64 %pfr
polled:
  %stopped = load i16, ptr %rv1, align 2
  %halt = icmp ne i16 %stopped, 0
  br i1 %halt, label %stop, label %again
stop:
  ret i64 {STOPPED}
timeout:
  ret i64 {TIMEOUT}
again:
  ret i64 0
}}

define i64 @sendbatch(ptr %ctx, ptr %fns) {{
entry:
  %vi = alloca i64, align 8
  %voff = alloca i64, align 8
  %vr = alloca i64, align 8
  %vpos = alloca i64, align 8
  %vleft = alloca i64, align 8
  %vdl = alloca i64, align 8
  %ts = alloca [2 x i64], align 8
  %pfd = alloca [2 x i64], align 8
  %fd64 = load i64, ptr %ctx, align 8
  %fd = trunc i64 %fd64 to i32
  %itp = getelementptr i64, ptr %ctx, i64 {_ITEMS}
  %iti = load i64, ptr %itp, align 8
  %items = inttoptr i64 %iti to ptr
  %nip = getelementptr i64, ptr %ctx, i64 {_NITEMS}
  %nitems = load i64, ptr %nip, align 8
  %bdp = getelementptr i64, ptr %ctx, i64 {_BOUND}
  %bound = load i64, ptr %bdp, align 8
  %clp = getelementptr i64, ptr %ctx, i64 {_CLOCK}
  %cl64 = load i64, ptr %clp, align 8
  %clock = trunc i64 %cl64 to i32
  %sendp = load ptr, ptr %fns, align 8
  %sfp = getelementptr ptr, ptr %fns, i64 1
  %sendfile = load ptr, ptr %sfp, align 8
  %donep = getelementptr i64, ptr %ctx, i64 {_DONE}
  %partp = getelementptr i64, ptr %ctx, i64 {_PARTIAL}
  store i64 0, ptr %donep, align 8
  store i64 0, ptr %partp, align 8
  store i64 0, ptr %vi, align 8
  br label %item
item:
  %i = load i64, ptr %vi, align 8
  %fin = icmp uge i64 %i, %nitems
  br i1 %fin, label %alldone, label %item.in
item.in:
  %i6 = mul i64 %i, {ITEM}
  %ip = getelementptr i64, ptr %items, i64 %i6
  %hpi = load i64, ptr %ip, align 8
  %hp = inttoptr i64 %hpi to ptr
  %hlp = getelementptr i64, ptr %ip, i64 1
  %hlen = load i64, ptr %hlp, align 8
  %ffp = getelementptr i64, ptr %ip, i64 2
  %ff64 = load i64, ptr %ffp, align 8
  %ffd = trunc i64 %ff64 to i32
  %rpp = getelementptr i64, ptr %ip, i64 3
  %rpi = load i64, ptr %rpp, align 8
  %rp = inttoptr i64 %rpi to ptr
  %nrp = getelementptr i64, ptr %ip, i64 4
  %nr = load i64, ptr %nrp, align 8
  %endp = getelementptr i64, ptr %ip, i64 5
  %memory = icmp slt i32 %ffd, 0
  %t0 = call i64 @now(ptr %fns, i32 %clock, ptr %ts)
  %dl = add i64 %t0, %bound
  store i64 %dl, ptr %vdl, align 8
  %some = icmp ugt i64 %nr, 0
  %flags = select i1 %some, i32 {_SEND_FLAGS | socket.MSG_MORE}, i32 {_SEND_FLAGS}
  store i64 0, ptr %voff, align 8
  br label %head
head:
  %off = load i64, ptr %voff, align 8
  %hdone = icmp uge i64 %off, %hlen
  br i1 %hdone, label %ranges, label %head.send
head.send:
  %hat = getelementptr i8, ptr %hp, i64 %off
  %hrest = sub i64 %hlen, %off
  %k = call i64 %sendp(i32 %fd, ptr %hat, i64 %hrest, i32 %flags)
  %kpos = icmp sgt i64 %k, 0
  br i1 %kpos, label %head.sent, label %head.err
head.sent:
  %off.n = add i64 %off, %k
  store i64 %off.n, ptr %voff, align 8
  store i64 1, ptr %partp, align 8
  br label %head
head.err:
  %dlh = load i64, ptr %vdl, align 8
  %wh = call i64 @trouble(ptr %ctx, ptr %fns, i64 %k, i64 %dlh, ptr %ts, ptr %pfd)
  %goh = icmp eq i64 %wh, 0
  br i1 %goh, label %head, label %fail.h
fail.h:
  ret i64 %wh
ranges:
  store i64 0, ptr %vr, align 8
  br label %range
range:
  %r = load i64, ptr %vr, align 8
  %rdone = icmp uge i64 %r, %nr
  br i1 %rdone, label %item.done, label %range.in
range.in:
  %r2 = shl i64 %r, 1
  %pp = getelementptr i64, ptr %rp, i64 %r2
  %pos0 = load i64, ptr %pp, align 8
  %r21 = add i64 %r2, 1
  %np = getelementptr i64, ptr %rp, i64 %r21
  %n0 = load i64, ptr %np, align 8
  store i64 %pos0, ptr %vpos, align 8
  store i64 %n0, ptr %vleft, align 8
  br label %sf
sf:
  %left = load i64, ptr %vleft, align 8
  %sfdone = icmp sle i64 %left, 0
  br i1 %sfdone, label %range.next, label %sf.call
sf.call:
  br i1 %memory, label %sm.call, label %sf.file
sf.file:
  %s.f = call i64 %sendfile(i32 %fd, i32 %ffd, ptr %vpos, i64 %left)
  br label %sf.got
sm.call:
  %at = load i64, ptr %vpos, align 8
  %atp = inttoptr i64 %at to ptr
  %s.m = call i64 %sendp(i32 %fd, ptr %atp, i64 %left, i32 {_SEND_FLAGS})
  %smpos = icmp sgt i64 %s.m, 0
  %smstep = select i1 %smpos, i64 %s.m, i64 0
  %at.n = add i64 %at, %smstep
  store i64 %at.n, ptr %vpos, align 8
  br label %sf.got
sf.got:
  %s = phi i64 [%s.f, %sf.file], [%s.m, %sm.call]
  %spos = icmp sgt i64 %s, 0
  br i1 %spos, label %sf.sent, label %sf.not
sf.sent:
  %left.n = sub i64 %left, %s
  store i64 %left.n, ptr %vleft, align 8
  store i64 1, ptr %partp, align 8
  br label %sf
sf.not:
  %szero = icmp eq i64 %s, 0
  br i1 %szero, label %ended, label %sf.err
sf.err:
  %dls = load i64, ptr %vdl, align 8
  %ws = call i64 @trouble(ptr %ctx, ptr %fns, i64 %s, i64 %dls, ptr %ts, ptr %pfd)
  %gos = icmp eq i64 %ws, 0
  br i1 %gos, label %sf, label %fail.s
fail.s:
  ret i64 %ws
range.next:
  %r.n = add i64 %r, 1
  store i64 %r.n, ptr %vr, align 8
  br label %range
item.done:
  %t1 = call i64 @now(ptr %fns, i32 %clock, ptr %ts)
  store i64 %t1, ptr %endp, align 8
  %i.n = add i64 %i, 1
  store i64 %i.n, ptr %donep, align 8
  store i64 0, ptr %partp, align 8
  store i64 %i.n, ptr %vi, align 8
  br label %item
ended:
  ret i64 {ENDED}
alldone:
  ret i64 {DONE}
}}
"""

_P = ctypes.c_void_p


class Kernel:
    """The compiled `sendbatch` and the C functions it calls."""

    def __init__(self, call: Callable[[int, int], int], fns: ctypes.Array[ctypes.c_void_p]
                 ) -> None:
        self.call = call
        self.fns = fns
        self.fns_at: int = ctypes.addressof(fns)


_keep: list[object] = []
"""The ctypes function over the compiled code, kept with it for the process's life."""


def _compile() -> Kernel | None:
    if (sys.platform != "linux" or sys.byteorder != "little"
            or struct.calcsize("@l") != 8 or not hasattr(socket, "MSG_MORE")):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        addresses = [ctypes.cast(getattr(libc, n), _P).value or 0 for n in _FNS]
    except (OSError, AttributeError) as e:
        log.info("peer replies are sent from the event loop: %s", e)
        return None
    try:
        compiled = compile_ir(_IR, ("sendbatch",), opt=2)
    except Exception as e:  # a JIT refused (e.g. no executable memory): the loop still sends
        log.warning("peer send kernel not compiled (%s); replies are sent from the event "
                    "loop", e)
        return None
    if compiled is None:
        return None
    # CFUNCTYPE: the GIL is released for the call (it waits for the network).
    call = ctypes.CFUNCTYPE(ctypes.c_int64, _P, _P)(compiled[0])
    fns = (_P * len(addresses))(*addresses)
    _keep.extend((call, fns))
    log.info("peer replies are sent in batches by a compiled call")
    return Kernel(call, fns)


_compiled = Lazy(_compile, "kvpool-send-jit")
kernel = _compiled.get
"""The compiled batch send (compiled once per process, by the first caller), or None."""
ready = _compiled.ready
"""The compiled batch send if compiled already, else None (never compiles)."""
compile_soon = _compiled.compile_soon
"""Compile it on a thread of its own, once per process."""


class Batch:
    """The replies of one call, packed for the kernel: each its head, then the byte
    `ranges` (offset, length) of `file`, or, where `file` is negative, (address, length)
    of this process's memory, copied into the socket (none: a head alone, ABSENT)."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.files: list[int] = []
        self.ranges: list[list[tuple[int, int]]] = []
        self.ctx = (ctypes.c_int64 * CTX_SLOTS)()
        self._items: ctypes.Array[ctypes.c_int64] | None = None
        self._keep: list[object] = []

    def __len__(self) -> int:
        return len(self.heads)

    def add(self, head: bytes, file: int, ranges: list[tuple[int, int]]) -> None:
        self.heads.append(head)
        self.files.append(file)
        self.ranges.append(ranges)

    def pack(self, fd: int, stop: int, bound: float) -> int:
        """The ctx's address for a call on socket `fd` (`stop`: the eventfd that ends a
        wait, -1 for none; `bound`: seconds each reply may take)."""
        n = len(self.heads)
        heads = bytearray(b"".join(self.heads))
        flat = [v for rs in self.ranges for r in rs for v in r]
        anchor = (ctypes.c_char * max(1, len(heads))).from_buffer(heads) if heads else None
        ranges = (ctypes.c_int64 * max(1, len(flat)))(*flat)
        items = (ctypes.c_int64 * (ITEM * n))()
        head_at = ctypes.addressof(anchor) if anchor is not None else 0
        range_at = ctypes.addressof(ranges)
        h = r = 0
        for i in range(n):
            length = len(self.heads[i])
            rs = self.ranges[i]
            j = ITEM * i
            items[j] = head_at + h
            items[j + 1] = length
            items[j + 2] = self.files[i]
            items[j + 3] = range_at + 16 * r
            items[j + 4] = len(rs)
            h += length
            r += len(rs)
        self._items = items
        self._keep = [heads, anchor, ranges]  # alive until the call is over
        c = self.ctx
        c[_FD], c[_STOP] = fd, stop
        c[_ITEMS], c[_NITEMS] = ctypes.addressof(items), n
        c[_BOUND] = int(bound * 1e9)
        c[_CLOCK] = time.CLOCK_MONOTONIC
        return ctypes.addressof(c)

    @property
    def done(self) -> int:
        """Replies that went out whole."""
        return self.ctx[_DONE]

    @property
    def partial(self) -> bool:
        """Some bytes of the reply after the last whole one went."""
        return bool(self.ctx[_PARTIAL])

    @property
    def errno(self) -> int:
        return self.ctx[_ERRNO]

    def end(self, i: int) -> float:
        """When reply `i`'s last byte was handed to the socket (time.monotonic)."""
        assert self._items is not None
        return self._items[ITEM * i + 5] / 1e9
