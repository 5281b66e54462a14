"""A peer read's reply received in one compiled call that never takes the GIL: the head,
the metadata and tenant name, then the chunk's bytes piece by piece through the worker's
buffer, XXH3 updated on each piece while it is in cache, each piece written into the
arena's mapping by the kernel (process_vm_writev), every wait bounded by the read's
deadline.

Why: the same steps in Python give the GIL up and take it back about five times a chunk
(the head's receive, the piece's, the hash, the write, the settle), and at each return the
receiving thread waits for the event loop's thread, which runs the clients' frames
meanwhile: at 1 MiB chunks that was most of what a read costs beyond its bytes
(docs/benchmarks.md, "The peer tier between two nodes"). Here the thread takes the GIL
once per reply, to compare the digest and settle the read.

`receive(ctx, fns) -> code` (LLVM IR, compiled by llvmlite at run time as the LOOKUP's
probes are: `kvpool.agent.jit`). `fns` are the C functions it calls (their addresses,
found by ctypes: libc's `recv`, `setsockopt`, `clock_gettime`, `process_vm_writev`,
`__errno_location`, `write`, and XXH3's streaming functions, which the `xxhash` wheel's
own extension module exports: no system libxxhash). `ctx` is an i64 array (the `_`
slots below): what the call reads (the socket, the request id, the room reserved, the
deadline in ns of CLOCK_MONOTONIC, the buffers, the arena mapping, the extents, an
eventfd to bump first: the previous read's wake-up of the event loop, `Settler`) and
what it answers (errno, where a write faulted, the digest). Codes:

- DONE: the reply was OK, of kind XXH3, and every byte is in the extents; `digest` is
  XXH3-64 of the metadata then the bytes (what `checksums.compute` gives).
- HEAD: only the reply's fixed part was received (into `head`), and it is one the
  compiled path does not take (ABSENT, another checksum kind, a request id, size or
  length the caller must refuse): the caller goes on in Python from there.
- TIMEOUT: the deadline passed (SO_RCVTIMEO, set before each receive to what is left of
  it, ran out: EAGAIN).
- CLOSED: the peer closed the connection before the reply's end.
- ERRNO: a system call failed (`errno`).
- FAULT: the kernel could not write a piece into the mapping (a page past a file a client
  shrank is EFAULT, never SIGBUS): the piece is in the buffer and already hashed; the
  caller writes what is left of it (`Arena.write_run` puts the file back and writes,
  or raises) and calls again from `resume`. (Received straight into the mapping, what
  the kernel could not put there is received into the buffer at the same place in the
  piece, hashed after what landed, and handed back the same way.)
- LOCAL: the mapping read under the SIGBUS guard cannot be trusted: a fault the guard
  answered with a zero page came during the reply (its checksum may have read zeros, a
  piece may have landed in a zero page), or one waits for its repair at the start (the
  caller repairs, `Arena.repair`, and calls again: nothing was received). Not the
  peer's doing.

Received straight into the mapping (`guard`, where the arena is guarded): each piece by
`recv` into its place in the arena (the kernel's copy), then XXH3 over it there, while
it is in cache: one copy, where the buffer's way costs two (the buffer, then
`process_vm_writev`, which also pins the arena's pages at every call). That read of the
mapping is the agent's only load from it, under `busguard`'s SIGBUS guard.

The compiled path needs llvmlite, the exported XXH3 functions, a 64-bit little-endian
Linux and an arena written through its mapping (`Arena.mapped_writes`); otherwise
`kernel()` is None or the caller does not ask, and the read goes the Python way
(`kvpool.agent.peers.links`), which TLS connections always take (records).
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable

from .. import busguard
from ..jit import Lazy, compile_ir
from . import wire

log = logging.getLogger(__name__)

DONE, HEAD, TIMEOUT, CLOSED, ERRNO, FAULT, LOCAL = range(7)

# ctx slots (i64): set by the caller...
_FD, _RID, _ROOM, _DEADLINE, _HEAD, _SIDE, _BUF, _BUFLEN, _STATE, _PID, _BASE = range(11)
_EXTENTS, _NEXTENTS, _START, _FLAGS, _LEVEL, _OPTION, _CLOCK, _WAKE, _ONE = range(11, 20)
# ...and by the call
_ERRNO, _FAULT_AT, _FAULT_FROM, _FAULT_TO, _RESUME, _DIGEST = range(20, 26)
# the SIGBUS guard's counts (0: receive through the buffer), and the call's own
_GUARD, _GOT, _SNAP = range(26, 29)
_CTX_SLOTS = 32
_FNS = ("recv", "setsockopt", "clock_gettime", "process_vm_writev", "__errno_location")
_XXH3 = ("XXH3_64bits_reset", "XXH3_64bits_update", "XXH3_64bits_digest")
_WRITE = 8
"""`fns`' slot of libc's `write` (after `_FNS` and `_XXH3`)."""

assert wire.REPLY.size == 28 and wire.REPLY.format == "<BBHIQQI", "the IR reads this layout"

_IR = f"""
define internal i64 @fill(ptr %ctx, ptr %fns, ptr %dst, i64 %n) {{
entry:
  %ts = alloca [2 x i64], align 8
  %tv = alloca [2 x i64], align 8
  %fd64 = load i64, ptr %ctx, align 8
  %fd = trunc i64 %fd64 to i32
  %dlp = getelementptr i64, ptr %ctx, i64 {_DEADLINE}
  %deadline = load i64, ptr %dlp, align 8
  %flp = getelementptr i64, ptr %ctx, i64 {_FLAGS}
  %fl64 = load i64, ptr %flp, align 8
  %flags = trunc i64 %fl64 to i32
  %lvp = getelementptr i64, ptr %ctx, i64 {_LEVEL}
  %lv64 = load i64, ptr %lvp, align 8
  %level = trunc i64 %lv64 to i32
  %opp = getelementptr i64, ptr %ctx, i64 {_OPTION}
  %op64 = load i64, ptr %opp, align 8
  %option = trunc i64 %op64 to i32
  %clp = getelementptr i64, ptr %ctx, i64 {_CLOCK}
  %cl64 = load i64, ptr %clp, align 8
  %clock = trunc i64 %cl64 to i32
  %recv = load ptr, ptr %fns, align 8
  %ssp = getelementptr ptr, ptr %fns, i64 1
  %setsockopt = load ptr, ptr %ssp, align 8
  %cgp = getelementptr ptr, ptr %fns, i64 2
  %gettime = load ptr, ptr %cgp, align 8
  %elp = getelementptr ptr, ptr %fns, i64 4
  %errno_at = load ptr, ptr %elp, align 8
  %tsn = getelementptr i64, ptr %ts, i64 1
  %tvu = getelementptr i64, ptr %tv, i64 1
  br label %loop
loop:
  %got = phi i64 [0, %entry], [%got, %interrupted], [%got.n, %some]
  %whole = icmp sge i64 %got, %n
  br i1 %whole, label %ok, label %clock.now
clock.now:
  %cr = call i32 %gettime(i32 %clock, ptr %ts)
  %sec = load i64, ptr %ts, align 8
  %nsec = load i64, ptr %tsn, align 8
  %sns = mul i64 %sec, 1000000000
  %now = add i64 %sns, %nsec
  %left = sub i64 %deadline, %now
  %over = icmp sle i64 %left, 0
  br i1 %over, label %timeout, label %arm
arm:
  %tsec = sdiv i64 %left, 1000000000
  %tns = srem i64 %left, 1000000000
  %tus = sdiv i64 %tns, 1000
  %tiny = icmp slt i64 %tus, 1
  %tus1 = select i1 %tiny, i64 1, i64 %tus
  store i64 %tsec, ptr %tv, align 8
  store i64 %tus1, ptr %tvu, align 8
  %sr = call i32 %setsockopt(i32 %fd, i32 %level, i32 %option, ptr %tv, i32 16)
  %sfail = icmp slt i32 %sr, 0
  br i1 %sfail, label %failed, label %take
take:
  %at = getelementptr i8, ptr %dst, i64 %got
  %want = sub i64 %n, %got
  %k = call i64 %recv(i32 %fd, ptr %at, i64 %want, i32 %flags)
  %pos = icmp sgt i64 %k, 0
  br i1 %pos, label %some, label %none
some:
  %got.n = add i64 %got, %k
  br label %loop
none:
  %zero = icmp eq i64 %k, 0
  br i1 %zero, label %closed, label %failed
failed:
  %gotp = getelementptr i64, ptr %ctx, i64 {_GOT}
  store i64 %got, ptr %gotp, align 8
  %ep = call ptr %errno_at()
  %e = load i32, ptr %ep, align 4
  %eintr = icmp eq i32 %e, 4
  br i1 %eintr, label %interrupted, label %other
interrupted:
  br label %loop
other:
  %eagain = icmp eq i32 %e, 11
  br i1 %eagain, label %timeout, label %error
error:
  %e64 = sext i32 %e to i64
  %erp = getelementptr i64, ptr %ctx, i64 {_ERRNO}
  store i64 %e64, ptr %erp, align 8
  ret i64 {ERRNO}
timeout:
  ret i64 {TIMEOUT}
closed:
  ret i64 {CLOSED}
ok:
  ret i64 {DONE}
}}

define internal i64 @put(ptr %ctx, ptr %fns, i64 %off, ptr %src, i64 %n) {{
entry:
  %local = alloca [2 x i64], align 8
  %remote = alloca [2 x i64], align 8
  %pidp = getelementptr i64, ptr %ctx, i64 {_PID}
  %pid64 = load i64, ptr %pidp, align 8
  %pid = trunc i64 %pid64 to i32
  %bp = getelementptr i64, ptr %ctx, i64 {_BASE}
  %base = load i64, ptr %bp, align 8
  %vmp = getelementptr ptr, ptr %fns, i64 3
  %writev = load ptr, ptr %vmp, align 8
  %elp = getelementptr ptr, ptr %fns, i64 4
  %errno_at = load ptr, ptr %elp, align 8
  %fromp = getelementptr i64, ptr %ctx, i64 {_FAULT_FROM}
  %ll = getelementptr i64, ptr %local, i64 1
  %rl = getelementptr i64, ptr %remote, i64 1
  %dst = add i64 %base, %off
  br label %loop
loop:
  %done = phi i64 [0, %entry], [%done.n, %wrote]
  %whole = icmp sge i64 %done, %n
  br i1 %whole, label %ok, label %write
write:
  %lp = getelementptr i8, ptr %src, i64 %done
  store ptr %lp, ptr %local, align 8
  %left = sub i64 %n, %done
  store i64 %left, ptr %ll, align 8
  %rp = add i64 %dst, %done
  store i64 %rp, ptr %remote, align 8
  store i64 %left, ptr %rl, align 8
  %got = call i64 %writev(i32 %pid, ptr %local, i64 1, ptr %remote, i64 1, i64 0)
  %pos = icmp sgt i64 %got, 0
  br i1 %pos, label %wrote, label %fault
wrote:
  %done.n = add i64 %done, %got
  br label %loop
fault:
  store i64 %done, ptr %fromp, align 8
  %neg = icmp slt i64 %got, 0
  br i1 %neg, label %errno, label %efault
errno:
  %ep = call ptr %errno_at()
  %e = load i32, ptr %ep, align 4
  %e64 = sext i32 %e to i64
  ret i64 %e64
efault:
  ret i64 14
ok:
  ret i64 0
}}

define i64 @receive(ptr %ctx, ptr %fns) {{
entry:
  %hp = getelementptr i64, ptr %ctx, i64 {_HEAD}
  %hi = load i64, ptr %hp, align 8
  %head = inttoptr i64 %hi to ptr
  %sp = getelementptr i64, ptr %ctx, i64 {_SIDE}
  %si = load i64, ptr %sp, align 8
  %side = inttoptr i64 %si to ptr
  %bp = getelementptr i64, ptr %ctx, i64 {_BUF}
  %bi = load i64, ptr %bp, align 8
  %buf = inttoptr i64 %bi to ptr
  %blp = getelementptr i64, ptr %ctx, i64 {_BUFLEN}
  %buflen = load i64, ptr %blp, align 8
  %stp = getelementptr i64, ptr %ctx, i64 {_STATE}
  %sti = load i64, ptr %stp, align 8
  %state = inttoptr i64 %sti to ptr
  %xp = getelementptr i64, ptr %ctx, i64 {_EXTENTS}
  %xi = load i64, ptr %xp, align 8
  %ext = inttoptr i64 %xi to ptr
  %nxp = getelementptr i64, ptr %ctx, i64 {_NEXTENTS}
  %next = load i64, ptr %nxp, align 8
  %startp = getelementptr i64, ptr %ctx, i64 {_START}
  %start = load i64, ptr %startp, align 8
  %rsp = getelementptr ptr, ptr %fns, i64 5
  %reset = load ptr, ptr %rsp, align 8
  %upp = getelementptr ptr, ptr %fns, i64 6
  %update = load ptr, ptr %upp, align 8
  %dgp = getelementptr ptr, ptr %fns, i64 7
  %digest = load ptr, ptr %dgp, align 8
  %wkp = getelementptr i64, ptr %ctx, i64 {_WAKE}
  %wk = load i64, ptr %wkp, align 8
  %owed = icmp sge i64 %wk, 0
  br i1 %owed, label %wake, label %begin
wake:
  %wrp = getelementptr ptr, ptr %fns, i64 {_WRITE}
  %write = load ptr, ptr %wrp, align 8
  %wk32 = trunc i64 %wk to i32
  %onep = getelementptr i64, ptr %ctx, i64 {_ONE}
  %wr = call i64 %write(i32 %wk32, ptr %onep, i64 8)
  store i64 -1, ptr %wkp, align 8
  br label %begin
begin:
  %gp = getelementptr i64, ptr %ctx, i64 {_GUARD}
  %gi = load i64, ptr %gp, align 8
  %direct = icmp ne i64 %gi, 0
  %counts = inttoptr i64 %gi to ptr
  %snapp = getelementptr i64, ptr %ctx, i64 {_SNAP}
  %fresh = icmp slt i64 %start, 0
  br i1 %fresh, label %guard, label %resume
guard:
  br i1 %direct, label %guard.in, label %head.in
guard.in:
  %faults = load atomic i64, ptr %counts seq_cst, align 8
  %repp = getelementptr i64, ptr %counts, i64 1
  %repairs = load atomic i64, ptr %repp seq_cst, align 8
  store i64 %faults, ptr %snapp, align 8
  %clean = icmp eq i64 %faults, %repairs
  br i1 %clean, label %head.in, label %local
local:
  ret i64 {LOCAL}
head.in:
  %c1 = call i64 @fill(ptr %ctx, ptr %fns, ptr %head, i64 28)
  %bad1 = icmp ne i64 %c1, {DONE}
  br i1 %bad1, label %fail1, label %parse
fail1:
  ret i64 %c1
parse:
  %status = load i8, ptr %head, align 1
  %kp = getelementptr i8, ptr %head, i64 1
  %kind = load i8, ptr %kp, align 1
  %tp = getelementptr i8, ptr %head, i64 2
  %tlen16 = load i16, ptr %tp, align 1
  %rp = getelementptr i8, ptr %head, i64 4
  %hrid32 = load i32, ptr %rp, align 1
  %szp = getelementptr i8, ptr %head, i64 8
  %size = load i64, ptr %szp, align 1
  %mp = getelementptr i8, ptr %head, i64 24
  %mlen32 = load i32, ptr %mp, align 1
  %ridp = getelementptr i64, ptr %ctx, i64 {_RID}
  %rid = load i64, ptr %ridp, align 8
  %roomp = getelementptr i64, ptr %ctx, i64 {_ROOM}
  %room = load i64, ptr %roomp, align 8
  %ok1 = icmp eq i8 %status, {wire.OK}
  %ok2 = icmp eq i8 %kind, 0
  %hrid = zext i32 %hrid32 to i64
  %ok3 = icmp eq i64 %hrid, %rid
  %ok4 = icmp ule i64 %size, %room
  %mlen = zext i32 %mlen32 to i64
  %ok5 = icmp ule i64 %mlen, {wire.MAX_META_BYTES}
  %tlen = zext i16 %tlen16 to i64
  %ok6 = icmp ule i64 %tlen, {wire.MAX_TENANT_BYTES}
  %a1 = and i1 %ok1, %ok2
  %a2 = and i1 %a1, %ok3
  %a3 = and i1 %a2, %ok4
  %a4 = and i1 %a3, %ok5
  %a5 = and i1 %a4, %ok6
  br i1 %a5, label %meta, label %handoff
handoff:
  ret i64 {HEAD}
meta:
  %mt = add i64 %mlen, %tlen
  %c2 = call i64 @fill(ptr %ctx, ptr %fns, ptr %side, i64 %mt)
  %bad2 = icmp ne i64 %c2, {DONE}
  br i1 %bad2, label %fail2, label %hashed
fail2:
  ret i64 %c2
hashed:
  %r0 = call i32 %reset(ptr %state)
  %r1 = call i32 %update(ptr %state, ptr %side, i64 %mlen)
  br label %body
resume:
  br label %body
body:
  %from = phi i64 [0, %hashed], [%start, %resume]
  %bszp = getelementptr i8, ptr %head, i64 8
  %bsize = load i64, ptr %bszp, align 1
  br label %extent
extent:
  %e = phi i64 [0, %body], [%e.n, %extent.next]
  %cpos = phi i64 [0, %body], [%cpos.n, %extent.next]
  %more = icmp ult i64 %e, %next
  %rest = sub i64 %bsize, %cpos
  %some = icmp sgt i64 %rest, 0
  %go = and i1 %more, %some
  br i1 %go, label %extent.in, label %finish
extent.in:
  %eo = shl i64 %e, 1
  %offp = getelementptr i64, ptr %ext, i64 %eo
  %off = load i64, ptr %offp, align 8
  %eo1 = add i64 %eo, 1
  %enp = getelementptr i64, ptr %ext, i64 %eo1
  %en = load i64, ptr %enp, align 8
  %short = icmp ult i64 %rest, %en
  %len = select i1 %short, i64 %rest, i64 %en
  %skip = sub i64 %from, %cpos
  %before = icmp slt i64 %skip, 0
  %d0 = select i1 %before, i64 0, i64 %skip
  br label %piece
piece:
  %d = phi i64 [%d0, %extent.in], [%d.n, %wrote]
  %inside = icmp ult i64 %d, %len
  br i1 %inside, label %piece.in, label %extent.next
piece.in:
  %pleft = sub i64 %len, %d
  %fits = icmp ult i64 %pleft, %buflen
  %m = select i1 %fits, i64 %pleft, i64 %buflen
  %aoff = add i64 %off, %d
  br i1 %direct, label %d.in, label %b.in
d.in:
  %dbp = getelementptr i64, ptr %ctx, i64 {_BASE}
  %dbase = load i64, ptr %dbp, align 8
  %daddr = add i64 %dbase, %aoff
  %dptr = inttoptr i64 %daddr to ptr
  %c4 = call i64 @fill(ptr %ctx, ptr %fns, ptr %dptr, i64 %m)
  %dok4 = icmp eq i64 %c4, {DONE}
  br i1 %dok4, label %d.hash, label %d.bad
d.hash:
  %r4 = call i32 %update(ptr %state, ptr %dptr, i64 %m)
  br label %wrote
d.bad:
  %err4 = icmp eq i64 %c4, {ERRNO}
  br i1 %err4, label %d.errno, label %d.fail
d.errno:
  %erp4 = getelementptr i64, ptr %ctx, i64 {_ERRNO}
  %e4 = load i64, ptr %erp4, align 8
  %efault = icmp eq i64 %e4, 14
  br i1 %efault, label %d.fault, label %d.fail
d.fail:
  ret i64 %c4
d.fault:
  %gotp4 = getelementptr i64, ptr %ctx, i64 {_GOT}
  %g4 = load i64, ptr %gotp4, align 8
  %r5 = call i32 %update(ptr %state, ptr %dptr, i64 %g4)
  %rest4 = sub i64 %m, %g4
  %bat = getelementptr i8, ptr %buf, i64 %g4
  %c5 = call i64 @fill(ptr %ctx, ptr %fns, ptr %bat, i64 %rest4)
  %dok5 = icmp eq i64 %c5, {DONE}
  br i1 %dok5, label %d.rest, label %d.fail5
d.fail5:
  ret i64 %c5
d.rest:
  %r6 = call i32 %update(ptr %state, ptr %bat, i64 %rest4)
  %fap4 = getelementptr i64, ptr %ctx, i64 {_FAULT_AT}
  store i64 %aoff, ptr %fap4, align 8
  %ffp4 = getelementptr i64, ptr %ctx, i64 {_FAULT_FROM}
  store i64 %g4, ptr %ffp4, align 8
  %ftp4 = getelementptr i64, ptr %ctx, i64 {_FAULT_TO}
  store i64 %m, ptr %ftp4, align 8
  %after4 = add i64 %cpos, %d
  %after4.m = add i64 %after4, %m
  %rsmp4 = getelementptr i64, ptr %ctx, i64 {_RESUME}
  store i64 %after4.m, ptr %rsmp4, align 8
  ret i64 {FAULT}
b.in:
  %c3 = call i64 @fill(ptr %ctx, ptr %fns, ptr %buf, i64 %m)
  %bad3 = icmp ne i64 %c3, {DONE}
  br i1 %bad3, label %fail3, label %hash
fail3:
  ret i64 %c3
hash:
  %r2 = call i32 %update(ptr %state, ptr %buf, i64 %m)
  %w = call i64 @put(ptr %ctx, ptr %fns, i64 %aoff, ptr %buf, i64 %m)
  %wbad = icmp ne i64 %w, 0
  br i1 %wbad, label %fault, label %wrote
fault:
  %erp = getelementptr i64, ptr %ctx, i64 {_ERRNO}
  store i64 %w, ptr %erp, align 8
  %fap = getelementptr i64, ptr %ctx, i64 {_FAULT_AT}
  store i64 %aoff, ptr %fap, align 8
  %ftp = getelementptr i64, ptr %ctx, i64 {_FAULT_TO}
  store i64 %m, ptr %ftp, align 8
  %after = add i64 %cpos, %d
  %after.m = add i64 %after, %m
  %rsmp = getelementptr i64, ptr %ctx, i64 {_RESUME}
  store i64 %after.m, ptr %rsmp, align 8
  ret i64 {FAULT}
wrote:
  %d.n = add i64 %d, %m
  br label %piece
extent.next:
  %e.n = add i64 %e, 1
  %cpos.n = add i64 %cpos, %en
  br label %extent
finish:
  br i1 %direct, label %guard.out, label %emit
guard.out:
  %faults.n = load atomic i64, ptr %counts seq_cst, align 8
  %snap = load i64, ptr %snapp, align 8
  %same = icmp eq i64 %faults.n, %snap
  br i1 %same, label %emit, label %local
emit:
  %dg = call i64 %digest(ptr %state)
  %dgo = getelementptr i64, ptr %ctx, i64 {_DIGEST}
  store i64 %dg, ptr %dgo, align 8
  ret i64 {DONE}
}}
"""

_P = ctypes.c_void_p


class _Kernel:
    """The compiled `receive` and the C functions it calls."""

    def __init__(self, receive: Callable[[int, int], int], fns: ctypes.Array[ctypes.c_void_p],
                 create_state: Callable[[], int | None],
                 free_state: Callable[[int], int]) -> None:
        self.receive = receive
        self.fns = fns
        self.fns_at: int = ctypes.addressof(fns)
        self.create_state = create_state
        self.free_state = free_state


def _symbols() -> tuple[list[int], Callable[[], int | None], Callable[[int], int]] | None:
    """The addresses `receive` calls (`_FNS` then `_XXH3`, the vectorised update where the
    wheel dispatches by CPU), and XXH3's state constructor and destructor; None where a
    symbol is missing."""
    try:
        import xxhash._xxhash as ext  # the extension module itself: its dynamic symbols

        libc = ctypes.CDLL(None, use_errno=True)
        xxh = ctypes.CDLL(ext.__file__)
        found = [getattr(libc, name) for name in _FNS]
        update = getattr(xxh, "XXH3_64bits_update_dispatch", None) or xxh.XXH3_64bits_update
        found += [xxh.XXH3_64bits_reset, update, xxh.XXH3_64bits_digest, libc.write]
        create, free = xxh.XXH3_createState, xxh.XXH3_freeState
    except (ImportError, OSError, AttributeError) as e:
        log.info("peer reads are received in Python: %s", e)
        return None
    create.restype, create.argtypes = _P, []
    free.restype, free.argtypes = ctypes.c_int, [_P]
    addresses = [ctypes.cast(f, _P).value or 0 for f in found]
    return addresses, create, free


_keep: list[object] = []
"""The ctypes function over the compiled code, kept with it for the process's life."""


def _compile() -> _Kernel | None:
    if (sys.platform != "linux" or sys.byteorder != "little"
            or struct.calcsize("@ll") != 16 or not hasattr(socket, "MSG_WAITALL")):
        return None
    symbols = _symbols()
    if symbols is None:
        return None
    addresses, create, free = symbols
    try:
        compiled = compile_ir(_IR, ("receive",), opt=2)
    except Exception as e:  # a JIT refused (e.g. no executable memory): Python still works
        log.warning("peer receive kernel not compiled (%s); replies are received in Python",
                    e)
        return None
    if compiled is None:
        return None
    # CFUNCTYPE: the GIL is released for the call (the receive waits for the network).
    receive = ctypes.CFUNCTYPE(ctypes.c_int64, _P, _P)(compiled[0])
    fns = (_P * len(addresses))(*addresses)
    _keep.extend((receive, fns))
    # Guarded arenas take the bytes straight into their mapping (None: through the buffer).
    busguard.guard()
    return _Kernel(receive, fns, create, free)


_compiled = Lazy(_compile, "kvpool-recv-jit")
kernel = _compiled.get
"""The compiled receive (compiled once per process, by the first caller), or None."""
ready = _compiled.ready
"""The compiled receive if compiled already, else None (never compiles: a read must not
wait ~0.2 s for a compile)."""
compile_soon = _compiled.compile_soon
"""Compile it on a thread of its own, once per process."""


class Receiver:
    """One thread's use of the kernel: its `ctx`, its head and metadata buffers, its XXH3
    state (freed with it), over the thread's piece buffer `buf`."""

    def __init__(self, k: _Kernel, buf: memoryview) -> None:
        self._k = k
        self.buf = buf
        self.head = bytearray(wire.REPLY.size)
        self.side = bytearray(wire.MAX_META_BYTES + wire.MAX_TENANT_BYTES)
        state = k.create_state()
        if not state:
            raise MemoryError("XXH3_createState")
        self._state = state
        weakref.finalize(self, k.free_state, state)
        self.ctx = (ctypes.c_int64 * _CTX_SLOTS)()
        self._ctx_at = ctypes.addressof(self.ctx)
        # ctypes objects over the buffers: they hold them exported (never resized) and give
        # their addresses.
        self._anchors = [ctypes.c_char.from_buffer(b) for b in (self.head, self.side, buf)]
        c = self.ctx
        c[_HEAD], c[_SIDE], c[_BUF] = (ctypes.addressof(a) for a in self._anchors)
        c[_BUFLEN] = len(buf)
        c[_STATE] = state
        c[_PID] = os.getpid()
        c[_FLAGS] = socket.MSG_WAITALL
        c[_LEVEL], c[_OPTION] = socket.SOL_SOCKET, socket.SO_RCVTIMEO
        c[_CLOCK] = time.CLOCK_MONOTONIC
        c[_WAKE], c[_ONE] = -1, 1
        self._extents = (ctypes.c_int64 * 0)()
        self.replies = 0
        """Replies received whole by the kernel (DONE) on this thread."""

    def start(self, fd: int, rid: int, room: int, deadline: float, base: int,
              extents: list[tuple[int, int]], wake: int = -1, guard: int = 0) -> int:
        """Receive one reply on `fd` (blocking) for request `rid` into `extents` of the
        mapping at `base` (at most `room` bytes), by `deadline` (time.monotonic); a code.
        `wake`: an eventfd the call first adds 1 to (a settled read's wake-up of the event
        loop, made without the GIL: `Settler.settle`'s `defer`), -1 for none. `guard`: the
        SIGBUS guard's counts (`busguard`, `Arena.guard_counts`) where the mapping may be
        read under it: each piece is then received straight into the mapping and hashed
        there; 0: through `buf`, then `process_vm_writev`."""
        c = self.ctx
        c[_WAKE] = wake
        c[_GUARD] = guard
        c[_FD], c[_RID], c[_ROOM] = fd, rid, room
        c[_DEADLINE] = int(deadline * 1e9)
        c[_BASE] = base
        flat = (ctypes.c_int64 * (2 * len(extents)))(*(v for e in extents for v in e))
        self._extents = flat  # alive for `resume`'s calls
        c[_EXTENTS], c[_NEXTENTS] = ctypes.addressof(flat), len(extents)
        c[_START] = -1
        return self._call()

    def resume(self) -> int:
        """After FAULT (its piece written by the caller): on from the next piece."""
        self.ctx[_START] = self.ctx[_RESUME]
        return self._call()

    def _call(self) -> int:
        code = self._k.receive(self._ctx_at, self._k.fns_at)
        if code == DONE:
            self.replies += 1
        return code

    @property
    def errno(self) -> int:
        return self.ctx[_ERRNO]

    def fault(self) -> tuple[int, int, int]:
        """After FAULT: the arena offset of the faulting piece, and the range of `buf` not
        written yet."""
        c = self.ctx
        return c[_FAULT_AT] + c[_FAULT_FROM], c[_FAULT_FROM], c[_FAULT_TO]

    @property
    def digest(self) -> int:
        return self.ctx[_DIGEST] & 0xFFFFFFFFFFFFFFFF

    def meta_and_tenant(self, meta_len: int, tenant_len: int) -> tuple[bytes, str]:
        side = self.side
        return (bytes(side[:meta_len]),
                bytes(side[meta_len : meta_len + tenant_len]).decode(errors="replace"))


_receivers = threading.local()


def receiver(buf: memoryview) -> Receiver | None:
    """This thread's receiver over `buf`, if the kernel is compiled already (never waits for
    a compile: `compile_soon` starts one)."""
    rx: Receiver | None = getattr(_receivers, "rx", None)
    if rx is None or rx.buf is not buf:
        k = ready()
        if k is None:
            return None
        rx = _receivers.rx = Receiver(k, buf)
    return rx
