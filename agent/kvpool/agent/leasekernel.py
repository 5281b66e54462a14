"""A lease-free read of a window in one compiled call: the table reads, the copies with
their sums and the checks after them, with no Python per chunk (`leasefree.read_planned`).

`leasefree.read_window` reads a window without a lease in Python, a few steps a key: the
slot's seqlock read, the target, the copy plan, then after the copy the checksum from the
sums and the slot read again. In an engine's process that Python runs cold (a prefill's
memory traffic evicts the interpreter's code and data between loads): ~0.15 ms of a 2k
load of 7 chunks, 5-7% of it (docs/benchmarks.md, "A load's lease-free read in compiled
calls"). When the caller knows every destination before the read (`HostTargets`: chunks of
one size and metadata into host ranges; `BlockTargets`: into block ids), the same steps
are loops here, in one call, `read(params, want, n, ids)`: `params` a `Plan`'s words (what
stays the same from one read to the next: the table, the arena, the chunks' size and
metadata, the buffers below, the blocks' geometry), `want` the `n` keys, `ids` the block
ids (null: the ranges are in `params`). It runs without the GIL (a ctypes call of C type)
and makes these steps, each an internal function:

- `expand` (block ids only): each chunk's ranges from its ids (see `hostcopy.HostBlocks`:
  for each layer, its blocks, adjacent ones in one range; the first chunk's first `skip`
  at the scratch block), written as `copy` takes them; -1 from `read` for an id outside the
  blocks (nothing read). Then the table's epoch (odd: nothing read).
- `locate(base, mask, want, n, size, meta_hash, limit, info)`: for each of the `n` keys
  (16 bytes each at `want`), its DRAM slot read under the seqlock as `lookupindex` reads
  it (the first word, the rest, a fence, the first word again; at most `READ_RETRIES`
  tries); a LIVE slot of the key, of a chunk in one extent inside the arena's `limit`
  bytes, of `size` bytes, metadata hash `meta_hash` and kind WSUM is found: its slot's byte
  offset in the table, its first word (seq | state << 32), the chunk's arena offset and
  checksum go to `info[4 i ..]`; any other key gets 0 at `info[4 i]` (its slot offset,
  never 0 for a slot: the header comes first). Returns the keys found (none: nothing
  read). Then, where a test set one, the hook (`leasefree.located`).
- `copy(piece, base, arena, want, info, n, ranges, starts, size, epoch, sums, msg, msglen,
  sums_at)`: for each key found, its `size` bytes from the arena into its ranges
  (`ranges[2 r]` address, `ranges[2 r + 1]` bytes, for r from `starts[i]` to
  `starts[i + 1]`), each piece by the copy-and-sum loop of `wsumkernel` (`piece`, its
  address) and the pieces' sums folded into the chunk's S0, S1 at `sums[2 i ..]`; a key
  whose ranges are too short or cut a 32-bit word gets 0 at `info[4 i]` instead (nothing
  copied). With `msglen` (17 to 240), the chunk's checksum too: `msg` is what WSUM hashes
  last (`checksums.wsum_message`: its head and the metadata), the chunk's sums written in
  at `sums_at`, hashed with XXH3-64 (its 17-to-240-byte forms, with XXH3's default secret,
  as xxhash computes them), 0 at `info[4 i]` where it is not the slot's checksum; with
  `msglen` 0 the caller checks the sums itself (`checksums.wsum_finish_many`). Then a fence
  (the streaming stores visible; the copies' loads before what follows), each found slot
  read again (the same first word, so the same seq and LIVE, and the same key) else 0 at
  `info[4 i]`, and last the table's epoch: 1 if it is still `epoch`, 0 if the table was
  rebuilt meanwhile (nothing read).

`read` returns the chunks read (each with `info[4 i]` not 0; where nothing is read, every
`info[4 i]` is 0). The steps besides the copies take about 1 µs for 7 chunks with warm
caches, ~15 µs cold, the ctypes call included (docs/benchmarks.md, "A load in one compiled
call").

Why the checks are the Python path's: see `leasefree` (the slot retired before its pages
are freed; x86-64's load order; `lookupindex.IndexReader.usable`).

Where llvmlite is missing or cannot compile, `ready()` is None and the window goes through
`leasefree.read_window`'s Python.
"""

from __future__ import annotations

import array
import ctypes
import logging
from collections.abc import Callable
from typing import Any

from . import wsumkernel
from .jit import Lazy, compile_ir
from .lookupkernel import XXH3_IR, slot_read

log = logging.getLogger(__name__)

READ_RETRIES = 16
"""Torn reads of a slot before the key is left to the socket (as `lookupindex`'s)."""
INFO_WORDS = 4
"""u64 words of `info` per key: slot offset (0: not read here), first word, arena offset,
checksum."""

MIN_MESSAGE, MAX_MESSAGE = 17, 240
"""The WSUM checksum's last hash is made here for its head and metadata of these many bytes
(XXH3's 17-to-240-byte forms): metadata of up to 201 bytes; longer, Python makes it."""
_PRIME64_1 = 0x9E3779B185EBCA87
_PRIME_MX1 = 0x165667919E3779F9
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
"""XXH3's default secret (its `kSecret`, 192 bytes): the checksum's hash is XXH3-64, seed 0."""
_SECRET_IR = "".join(f"\\{b:02X}" for b in _SECRET)
_HEADER = 64
_SLOT = 64
_SLOT_FIELDS = (("o", 24, "i64"), ("s", 32, "i64"), ("c", 40, "i64"), ("m", 48, "i64"),
                ("kind", 56, "i32"))
"""What `locate` reads of a slot beside its first word and key, under the same seqlock:
the chunk's arena offset, size, checksum, metadata hash and checksum kind (`lookupindex`'s
slot layout), as %so, %ss, %sc, %sm, %skind."""
_EPOCH_AT = 16
_WSUM = 1
"""`checksums.WSUM`: the only kind whose check the copy's own sums give."""

PARAMS = ("piece", "table", "mask", "arena", "limit", "size", "meta_hash", "info", "sums",
          "msg", "msglen", "sums_at", "ranges", "starts", "skip", "bases", "layers", "stride",
          "nbytes", "per", "scratch", "blocks", "hook", "cycles")
"""The words of `read`'s parameter block (`Plan`), in order. `cycles`: written by `read`,
the CPU's cycle counter's ticks in its copies (`copy`, which also hashes the checksums and
reads the slots again after them), added up (for a benchmark: `cycles()`)."""
_POINTERS = {"piece", "table", "arena", "info", "sums", "msg", "ranges", "starts", "bases",
             "hook"}


def _params_ir() -> str:
    """IR loading each word of the parameter block %p into %P.<name> (a pointer or i64)."""
    out = []
    for i, name in enumerate(PARAMS):
        ty = "ptr" if name in _POINTERS else "i64"
        out.append(f"  %P.{name}.p = getelementptr i64, ptr %p, i64 {i}\n"
                   f"  %P.{name} = load {ty}, ptr %P.{name}.p, align 8")
    return "\n".join(out)


_IR = f"""
declare i64 @llvm.bswap.i64(i64)
declare i64 @llvm.readcyclecounter()
declare i64 @llvm.umin.i64(i64, i64)
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)

{XXH3_IR}

; XXH3-64 (seed 0) of 17 to 240 bytes, as xxhash computes it (XXH3_len_17to128_64b,
; XXH3_len_129to240_64b): the checksum's last step, over the WSUM head and the metadata.
@secret = internal constant [192 x i8] c"{_SECRET_IR}"

define internal i64 @avalanche(i64 %h) alwaysinline nounwind {{
  %a.1 = lshr i64 %h, 37
  %a.2 = xor i64 %h, %a.1
  %a.3 = mul i64 %a.2, {_PRIME_MX1}
  %a.4 = lshr i64 %a.3, 32
  %a = xor i64 %a.3, %a.4
  ret i64 %a
}}

define internal i64 @mix16(ptr %d, i64 %s) alwaysinline nounwind {{
  %sp = getelementptr i8, ptr @secret, i64 %s
  %sp8 = getelementptr i8, ptr %sp, i64 8
  %d8 = getelementptr i8, ptr %d, i64 8
  %lo.d = load i64, ptr %d, align 1
  %hi.d = load i64, ptr %d8, align 1
  %lo.s = load i64, ptr %sp, align 1
  %hi.s = load i64, ptr %sp8, align 1
  %lo = xor i64 %lo.d, %lo.s
  %hi = xor i64 %hi.d, %hi.s
  %lo.w = zext i64 %lo to i128
  %hi.w = zext i64 %hi to i128
  %prod = mul i128 %lo.w, %hi.w
  %prod.lo = trunc i128 %prod to i64
  %prod.sh = lshr i128 %prod, 64
  %prod.hi = trunc i128 %prod.sh to i64
  %fold = xor i64 %prod.lo, %prod.hi
  ret i64 %fold
}}

define internal i64 @xxh3_mid(ptr %d, i64 %n) nounwind {{
entry:
  %acc0 = mul i64 %n, {_PRIME64_1}
  %big = icmp ugt i64 %n, 128
  br i1 %big, label %mid, label %small
small:
  %n1 = sub i64 %n, 1
  %r0 = lshr i64 %n1, 5
  %rounds = add i64 %r0, 1
  br label %sloop
sloop:
  %k = phi i64 [0, %small], [%k.n, %sloop]
  %acc = phi i64 [%acc0, %small], [%acc.n, %sloop]
  %o1 = shl i64 %k, 4
  %s1 = shl i64 %k, 5
  %p1 = getelementptr i8, ptr %d, i64 %o1
  %m1 = call i64 @mix16(ptr %p1, i64 %s1)
  %k.n = add i64 %k, 1
  %o2.0 = shl i64 %k.n, 4
  %o2 = sub i64 %n, %o2.0
  %p2 = getelementptr i8, ptr %d, i64 %o2
  %s2 = add i64 %s1, 16
  %m2 = call i64 @mix16(ptr %p2, i64 %s2)
  %acc.1 = add i64 %acc, %m1
  %acc.n = add i64 %acc.1, %m2
  %more = icmp ult i64 %k.n, %rounds
  br i1 %more, label %sloop, label %sdone
sdone:
  %hs = call i64 @avalanche(i64 %acc.n)
  ret i64 %hs
mid:
  %j = phi i64 [0, %entry], [%j.n, %mid]
  %macc = phi i64 [%acc0, %entry], [%macc.n, %mid]
  %jo = shl i64 %j, 4
  %jp = getelementptr i8, ptr %d, i64 %jo
  %jm = call i64 @mix16(ptr %jp, i64 %jo)
  %macc.n = add i64 %macc, %jm
  %j.n = add i64 %j, 1
  %jmore = icmp ult i64 %j.n, 8
  br i1 %jmore, label %mid, label %mid2
mid2:
  %av = call i64 @avalanche(i64 %macc.n)
  %nb = lshr i64 %n, 4
  %any = icmp ugt i64 %nb, 8
  br i1 %any, label %tail, label %last
tail:
  %t = phi i64 [8, %mid2], [%t.n, %tail]
  %tacc = phi i64 [%av, %mid2], [%tacc.n, %tail]
  %to = shl i64 %t, 4
  %tp = getelementptr i8, ptr %d, i64 %to
  %ts.0 = sub i64 %to, 128
  %ts = add i64 %ts.0, 3
  %tm = call i64 @mix16(ptr %tp, i64 %ts)
  %tacc.n = add i64 %tacc, %tm
  %t.n = add i64 %t, 1
  %tmore = icmp ult i64 %t.n, %nb
  br i1 %tmore, label %tail, label %last
last:
  %lacc = phi i64 [%av, %mid2], [%tacc.n, %tail]
  %lo = sub i64 %n, 16
  %lp = getelementptr i8, ptr %d, i64 %lo
  %lm = call i64 @mix16(ptr %lp, i64 119)
  %lacc.n = add i64 %lacc, %lm
  %hm = call i64 @avalanche(i64 %lacc.n)
  ret i64 %hm
}}

define i64 @cycles() nounwind {{
  %c = call i64 @llvm.readcyclecounter()
  ret i64 %c
}}

define i64 @xxh3_bytes(ptr %d, i64 %n) nounwind {{
  %h = call i64 @xxh3_mid(ptr %d, i64 %n)
  ret i64 %h
}}

define i64 @locate(ptr %base, i64 %mask, ptr %want, i64 %n, i64 %size, i64 %mhash,
                   i64 %limit, ptr %info) nounwind {{
entry:
  %none = icmp eq i64 %n, 0
  br i1 %none, label %done, label %key
key:
  %i = phi i64 [0, %entry], [%i.n, %next]
  %found = phi i64 [0, %entry], [%found.n, %next]
  %wo = shl i64 %i, 4
  %wp0 = getelementptr i8, ptr %want, i64 %wo
  %wp1 = getelementptr i8, ptr %wp0, i64 8
  %k0 = load i64, ptr %wp0, align 1
  %k1 = load i64, ptr %wp1, align 1
  %h = call i64 @xxh3(i64 %k0, i64 %k1)
  %home = and i64 %h, %mask
  %io = mul i64 %i, {INFO_WORDS}
  %ip = getelementptr i64, ptr %info, i64 %io
  br label %swalk
swalk:
  %at = phi i64 [%home, %key], [%at.n, %step]
  %steps = phi i64 [0, %key], [%steps.n, %step]
  %off.0 = mul i64 %at, {_SLOT}
  %off = add i64 %off.0, {_HEADER}
{slot_read("s", "base", "off", "miss", "good", _SLOT_FIELDS)}
good:
  %state = lshr i64 %sw, 32
  %empty = icmp eq i64 %state, 0
  br i1 %empty, label %miss, label %used
used:
  %live = icmp eq i64 %state, 1
  %e0 = icmp eq i64 %sk0, %k0
  %e1 = icmp eq i64 %sk1, %k1
  %same = and i1 %e0, %e1
  %hit = and i1 %live, %same
  br i1 %hit, label %check, label %step
step:
  %at.1 = add i64 %at, 1
  %at.n = and i64 %at.1, %mask
  %steps.n = add i64 %steps, 1
  %more = icmp ule i64 %steps.n, %mask
  br i1 %more, label %swalk, label %miss
check:
  ; the size, metadata and kind asked for, one extent inside the arena (NO_EXTENT, all
  ; ones, is past any arena)
  %c.size = icmp eq i64 %ss, %size
  %c.meta = icmp eq i64 %sm, %mhash
  %c.kind = icmp eq i32 %skind, {_WSUM}
  %c.fits = icmp ule i64 %ss, %limit
  %room = sub i64 %limit, %ss
  %c.in = icmp ule i64 %so, %room
  %ok.1 = and i1 %c.size, %c.meta
  %ok.2 = and i1 %ok.1, %c.kind
  %ok.3 = and i1 %ok.2, %c.fits
  %ok = and i1 %ok.3, %c.in
  br i1 %ok, label %hitkey, label %miss
hitkey:
  store i64 %off, ptr %ip, align 8
  %ip1 = getelementptr i64, ptr %ip, i64 1
  store i64 %sw, ptr %ip1, align 8
  %ip2 = getelementptr i64, ptr %ip, i64 2
  store i64 %so, ptr %ip2, align 8
  %ip3 = getelementptr i64, ptr %ip, i64 3
  store i64 %sc, ptr %ip3, align 8
  %found.h = add i64 %found, 1
  br label %next
miss:
  store i64 0, ptr %ip, align 8
  br label %next
next:
  %found.n = phi i64 [%found.h, %hitkey], [%found, %miss]
  %i.n = add i64 %i, 1
  %again.k = icmp ult i64 %i.n, %n
  br i1 %again.k, label %key, label %done
done:
  %all = phi i64 [0, %entry], [%found.n, %next]
  ret i64 %all
}}

define i64 @copy(ptr %piece, ptr %base, ptr %arena, ptr %want, ptr %info, i64 %n,
                 ptr %ranges, ptr %starts, i64 %size, i64 %epoch, ptr %sums, ptr %msg,
                 i64 %msglen, i64 %sums_at) nounwind {{
entry:
  %tmp = alloca [2 x i64], align 8
  %tmp1 = getelementptr i64, ptr %tmp, i64 1
  %head = alloca [{MAX_MESSAGE} x i8], align 8
  %checking = icmp ne i64 %msglen, 0
  br i1 %checking, label %headed, label %start
headed:
  call void @llvm.memcpy.p0.p0.i64(ptr %head, ptr %msg, i64 %msglen, i1 false)
  br label %start
start:
  %hs0 = getelementptr i8, ptr %head, i64 %sums_at
  %hs1 = getelementptr i8, ptr %hs0, i64 8
  %none = icmp eq i64 %n, 0
  br i1 %none, label %fenced, label %key
key:
  %i = phi i64 [0, %start], [%i.n, %knext]
  %io = mul i64 %i, {INFO_WORDS}
  %ip = getelementptr i64, ptr %info, i64 %io
  %at = load i64, ptr %ip, align 8
  %has = icmp ne i64 %at, 0
  br i1 %has, label %validate, label %knext
validate:
  %rp0 = getelementptr i64, ptr %starts, i64 %i
  %rp1 = getelementptr i64, ptr %rp0, i64 1
  %r0 = load i64, ptr %rp0, align 8
  %r1 = load i64, ptr %rp1, align 8
  br label %vloop
vloop:
  %r = phi i64 [%r0, %validate], [%r.n, %vstep]
  %left = phi i64 [%size, %validate], [%left.n, %vstep]
  %vdone = icmp eq i64 %left, 0
  br i1 %vdone, label %copy0, label %vhas
vhas:
  %vend = icmp uge i64 %r, %r1
  br i1 %vend, label %reject, label %vrange
vrange:
  %lo.0 = shl i64 %r, 1
  %lo = add i64 %lo.0, 1
  %lp = getelementptr i64, ptr %ranges, i64 %lo
  %len = load i64, ptr %lp, align 8
  %pc = call i64 @llvm.umin.i64(i64 %len, i64 %left)
  %mis = and i64 %pc, 3
  %cut = icmp ne i64 %mis, 0
  br i1 %cut, label %reject, label %vstep
vstep:
  %left.n = sub i64 %left, %pc
  %r.n = add i64 %r, 1
  br label %vloop
reject:
  store i64 0, ptr %ip, align 8
  br label %knext
copy0:
  %sop = getelementptr i64, ptr %ip, i64 2
  %so = load i64, ptr %sop, align 8
  %src0 = getelementptr i8, ptr %arena, i64 %so
  br label %cloop
cloop:
  %cr = phi i64 [%r0, %copy0], [%cr.n, %cpiece]
  %cleft = phi i64 [%size, %copy0], [%cleft.n, %cpiece]
  %src = phi ptr [%src0, %copy0], [%src.n, %cpiece]
  %s0 = phi i64 [0, %copy0], [%s0.n, %cpiece]
  %s1 = phi i64 [0, %copy0], [%s1.n, %cpiece]
  %words = phi i64 [0, %copy0], [%words.n, %cpiece]
  %cdone = icmp eq i64 %cleft, 0
  br i1 %cdone, label %cend, label %cpiece
cpiece:
  %da.0 = shl i64 %cr, 1
  %dap = getelementptr i64, ptr %ranges, i64 %da.0
  %da = load i64, ptr %dap, align 8
  %dst = inttoptr i64 %da to ptr
  %dlp = getelementptr i64, ptr %dap, i64 1
  %dlen = load i64, ptr %dlp, align 8
  %cpc = call i64 @llvm.umin.i64(i64 %dlen, i64 %cleft)
  call void %piece(ptr %src, ptr %dst, i64 %cpc, ptr %tmp)
  %t0 = load i64, ptr %tmp, align 8
  %t1 = load i64, ptr %tmp1, align 8
  %s0.n = add i64 %s0, %t0
  %wt = mul i64 %words, %t0
  %s1.p = add i64 %s1, %t1
  %s1.n = add i64 %s1.p, %wt
  %pw = lshr i64 %cpc, 2
  %words.n = add i64 %words, %pw
  %src.n = getelementptr i8, ptr %src, i64 %cpc
  %cleft.n = sub i64 %cleft, %cpc
  %cr.n = add i64 %cr, 1
  br label %cloop
cend:
  %so.0 = shl i64 %i, 1
  %sp0 = getelementptr i64, ptr %sums, i64 %so.0
  %sp1 = getelementptr i64, ptr %sp0, i64 1
  store i64 %s0, ptr %sp0, align 8
  store i64 %s1, ptr %sp1, align 8
  br i1 %checking, label %digest, label %knext
digest:
  ; the checksum: XXH3-64 of the WSUM head (its sums written in) and the metadata
  store i64 %s0, ptr %hs0, align 1
  store i64 %s1, ptr %hs1, align 1
  %got = call i64 @xxh3_mid(ptr %head, i64 %msglen)
  %ckp = getelementptr i64, ptr %ip, i64 3
  %wanted = load i64, ptr %ckp, align 8
  %match = icmp eq i64 %got, %wanted
  br i1 %match, label %knext, label %reject
knext:
  %i.n = add i64 %i, 1
  %kmore = icmp ult i64 %i.n, %n
  br i1 %kmore, label %key, label %fenced
fenced:
  ; the streaming stores made visible, and every load of the copies done before the
  ; slots are read again
  fence seq_cst
  %rnone = icmp eq i64 %n, 0
  br i1 %rnone, label %epochs, label %rkey
rkey:
  %j = phi i64 [0, %fenced], [%j.n, %rnext]
  %jo = mul i64 %j, {INFO_WORDS}
  %jp = getelementptr i64, ptr %info, i64 %jo
  %jat = load i64, ptr %jp, align 8
  %jhas = icmp ne i64 %jat, 0
  br i1 %jhas, label %rread, label %rnext
rread:
  %sp = getelementptr i8, ptr %base, i64 %jat
  %spk0 = getelementptr i8, ptr %sp, i64 8
  %spk1 = getelementptr i8, ptr %sp, i64 16
  %rw = load atomic i64, ptr %sp acquire, align 8
  %rk0 = load atomic i64, ptr %spk0 monotonic, align 8
  %rk1 = load atomic i64, ptr %spk1 monotonic, align 8
  fence acquire
  %rw2 = load atomic i64, ptr %sp monotonic, align 8
  %jp1 = getelementptr i64, ptr %jp, i64 1
  %was = load i64, ptr %jp1, align 8
  %jwo = shl i64 %j, 4
  %jk0p = getelementptr i8, ptr %want, i64 %jwo
  %jk1p = getelementptr i8, ptr %jk0p, i64 8
  %jk0 = load i64, ptr %jk0p, align 1
  %jk1 = load i64, ptr %jk1p, align 1
  %q1 = icmp eq i64 %rw, %was
  %q2 = icmp eq i64 %rw2, %was
  %q3 = icmp eq i64 %rk0, %jk0
  %q4 = icmp eq i64 %rk1, %jk1
  %q12 = and i1 %q1, %q2
  %q34 = and i1 %q3, %q4
  %kept = and i1 %q12, %q34
  br i1 %kept, label %rnext, label %rfail
rfail:
  store i64 0, ptr %jp, align 8
  br label %rnext
rnext:
  %j.n = add i64 %j, 1
  %rmore = icmp ult i64 %j.n, %n
  br i1 %rmore, label %rkey, label %epochs
epochs:
  ; the epoch after every slot (a rebuild makes it odd before it writes any slot)
  %ep = getelementptr i8, ptr %base, i64 {_EPOCH_AT}
  %now = load atomic i64, ptr %ep acquire, align 8
  %kept.e = icmp eq i64 %now, %epoch
  %r.e = zext i1 %kept.e to i64
  ret i64 %r.e
}}

; The destinations of `n` chunks from their block ids (`ids`, `per` a chunk: each in
; [0, blocks)): chunk i is, for each layer in turn, its blocks, block b of layer l at
; bases[l] + b * stride, `nbytes` each; the first `skip` blocks of chunk 0 at `scratch`.
; Written as `copy` takes them (`ranges` pairs, `starts`), a range that ends where the
; next block begins grown instead (within a chunk). 1 (nothing written) for an id outside.
define internal i64 @expand(ptr %ids, i64 %n, i64 %skip, ptr %bases, i64 %layers,
                            i64 %stride, i64 %nbytes, i64 %per, i64 %scratch, i64 %blocks,
                            ptr %ranges, ptr %starts) nounwind {{
entry:
  %total = mul i64 %n, %per
  %any = icmp ne i64 %total, 0
  br i1 %any, label %vloop, label %expand0
vloop:
  %v = phi i64 [0, %entry], [%v.n, %vok]
  %vp = getelementptr i64, ptr %ids, i64 %v
  %vid = load i64, ptr %vp, align 8
  %vbad = icmp uge i64 %vid, %blocks
  br i1 %vbad, label %refuse, label %vok
vok:
  %v.n = add i64 %v, 1
  %vmore = icmp ult i64 %v.n, %total
  br i1 %vmore, label %vloop, label %expand0
refuse:
  ret i64 1
expand0:
  store i64 0, ptr %starts, align 8
  %empty = icmp eq i64 %total, 0
  br i1 %empty, label %done, label %chunk
chunk:
  %i = phi i64 [0, %expand0], [%i.n, %chunk_end]
  %rc = phi i64 [0, %expand0], [%r.n, %chunk_end]
  %first = icmp eq i64 %i, 0
  %cskip = select i1 %first, i64 %skip, i64 0
  %ibase = mul i64 %i, %per
  br label %layer
layer:
  %l = phi i64 [0, %chunk], [%l.n, %layer_end]
  %rl = phi i64 [%rc, %chunk], [%r.n, %layer_end]
  %bp = getelementptr i64, ptr %bases, i64 %l
  %lbase = load i64, ptr %bp, align 8
  br label %block
block:
  %j = phi i64 [0, %layer], [%j.n, %block_end]
  %r = phi i64 [%rl, %layer], [%r.n, %block_end]
  %sk = icmp ult i64 %j, %cskip
  %idx = add i64 %ibase, %j
  %ip = getelementptr i64, ptr %ids, i64 %idx
  %id = load i64, ptr %ip, align 8
  %off = mul i64 %id, %stride
  %real = add i64 %lbase, %off
  %dst = select i1 %sk, i64 %scratch, i64 %real
  %has = icmp ugt i64 %r, %rc
  br i1 %has, label %adj, label %new
adj:
  %pr = sub i64 %r, 1
  %pa.i = shl i64 %pr, 1
  %pap = getelementptr i64, ptr %ranges, i64 %pa.i
  %pa = load i64, ptr %pap, align 8
  %plp = getelementptr i64, ptr %pap, i64 1
  %pl = load i64, ptr %plp, align 8
  %pend = add i64 %pa, %pl
  %follows = icmp eq i64 %pend, %dst
  br i1 %follows, label %grow, label %new
grow:
  %pl.n = add i64 %pl, %nbytes
  store i64 %pl.n, ptr %plp, align 8
  br label %block_end
new:
  %na.i = shl i64 %r, 1
  %nap = getelementptr i64, ptr %ranges, i64 %na.i
  store i64 %dst, ptr %nap, align 8
  %nlp = getelementptr i64, ptr %nap, i64 1
  store i64 %nbytes, ptr %nlp, align 8
  %r.new = add i64 %r, 1
  br label %block_end
block_end:
  %r.n = phi i64 [%r, %grow], [%r.new, %new]
  %j.n = add i64 %j, 1
  %jmore = icmp ult i64 %j.n, %per
  br i1 %jmore, label %block, label %layer_end
layer_end:
  %l.n = add i64 %l, 1
  %lmore = icmp ult i64 %l.n, %layers
  br i1 %lmore, label %layer, label %chunk_end
chunk_end:
  %i.n = add i64 %i, 1
  %sp = getelementptr i64, ptr %starts, i64 %i.n
  store i64 %r.n, ptr %sp, align 8
  %imore = icmp ult i64 %i.n, %n
  br i1 %imore, label %chunk, label %done
done:
  ret i64 0
}}

; The whole lease-free read of `n` keys in one call (see the module): `p` the parameters
; (`Plan`'s words), `ids` the block ids (null: `ranges` and `starts` given).
define i64 @read(ptr %p, ptr %want, i64 %n, ptr %ids) nounwind {{
entry:
{_params_ir()}
  %hasids = icmp ne ptr %ids, null
  br i1 %hasids, label %expand, label %table
expand:
  %bad = call i64 @expand(ptr %ids, i64 %n, i64 %P.skip, ptr %P.bases, i64 %P.layers,
                          i64 %P.stride, i64 %P.nbytes, i64 %P.per, i64 %P.scratch,
                          i64 %P.blocks, ptr %P.ranges, ptr %P.starts)
  %refused = icmp ne i64 %bad, 0
  br i1 %refused, label %refuse, label %table
refuse:
  ret i64 -1
table:
  %epp = getelementptr i8, ptr %P.table, i64 {_EPOCH_AT}
  %epoch = load atomic i64, ptr %epp acquire, align 8
  %odd = trunc i64 %epoch to i1
  br i1 %odd, label %none, label %find
find:
  %found = call i64 @locate(ptr %P.table, i64 %P.mask, ptr %want, i64 %n, i64 %P.size,
                            i64 %P.meta_hash, i64 %P.limit, ptr %P.info)
  %nothing = icmp eq i64 %found, 0
  br i1 %nothing, label %gone, label %hooked
hooked:
  %hashook = icmp ne ptr %P.hook, null
  br i1 %hashook, label %callhook, label %copying
callhook:
  call void %P.hook()
  br label %copying
copying:
  %cy0 = call i64 @llvm.readcyclecounter()
  %kept = call i64 @copy(ptr %P.piece, ptr %P.table, ptr %P.arena, ptr %want, ptr %P.info,
                         i64 %n, ptr %P.ranges, ptr %P.starts, i64 %P.size, i64 %epoch,
                         ptr %P.sums, ptr %P.msg, i64 %P.msglen, i64 %P.sums_at)
  %cy1 = call i64 @llvm.readcyclecounter()
  %cyd = sub i64 %cy1, %cy0
  %cyall = add i64 %P.cycles, %cyd
  store i64 %cyall, ptr %P.cycles.p, align 8
  %lost = icmp eq i64 %kept, 0
  br i1 %lost, label %none, label %count
count:
  %c = phi i64 [0, %copying], [%c.n, %count]
  %got = phi i64 [0, %copying], [%got.n, %count]
  %co = mul i64 %c, {INFO_WORDS}
  %cp = getelementptr i64, ptr %P.info, i64 %co
  %cat = load i64, ptr %cp, align 8
  %cread = icmp ne i64 %cat, 0
  %cone = zext i1 %cread to i64
  %got.n = add i64 %got, %cone
  %c.n = add i64 %c, 1
  %cmore = icmp ult i64 %c.n, %n
  br i1 %cmore, label %count, label %counted
counted:
  ret i64 %got.n
none:
  %zn = icmp eq i64 %n, 0
  br i1 %zn, label %gone, label %zero
zero:
  %z = phi i64 [0, %none], [%z.n, %zero]
  %zo = mul i64 %z, {INFO_WORDS}
  %zp = getelementptr i64, ptr %P.info, i64 %zo
  store i64 0, ptr %zp, align 8
  %z.n = add i64 %z, 1
  %zmore = icmp ult i64 %z.n, %n
  br i1 %zmore, label %zero, label %gone
gone:
  ret i64 0
}}
"""

_P = ctypes.c_void_p
_I = ctypes.c_int64
_AT = {name: i for i, name in enumerate(PARAMS)}


class Kernels:
    def __init__(self, read: Callable[[int, bytes, int, int], int],
                 digest: Callable[..., int], piece: int, cycles: Callable[[], int]) -> None:
        self.read = read
        """`read(params, want, n, ids)`, see the module: `params` the address of a `Plan`'s
        words, `want` the keys (16 bytes each), `ids` the address of the block ids (0:
        destinations given as ranges). It lets the GIL go (a ctypes call of C type)."""
        self._digest = digest
        self.piece = piece
        self.cycles = cycles
        """The CPU's cycle counter now (x86-64: its time-stamp counter; 0 where it has
        none): what `Plan.words`' `cycles` counts in."""

    def xxh3(self, data: bytes) -> int:
        """XXH3-64 of `data` (MIN_MESSAGE to MAX_MESSAGE bytes) as the read call makes it."""
        if not MIN_MESSAGE <= len(data) <= MAX_MESSAGE:
            raise ValueError(f"{len(data)} bytes")
        return self._digest(data, len(data))


class Plan:
    """`read`'s parameter block for one mapping (lookup table and arena) and one form of
    destinations, made once and reused by each read of it, with the buffers the call
    writes (each key's slot words and sums; the destinations it plans from block ids),
    grown as a read needs. Not thread-safe: one client's reads, one at a time.

    `message`, `sums_at`: the WSUM checksum's input (`checksums.wsum_message`, MIN_MESSAGE
    to MAX_MESSAGE bytes; empty: the caller finishes each checksum from the sums). `blocks`:
    the destinations' blocks (`hostcopy.HostBlocks`), for reads whose destinations are
    block ids; None: reads give ranges (`ranges`, `starts`)."""

    def __init__(self, kernels: Kernels, table: int, mask: int, arena: int, limit: int,
                 size: int, meta_hash: int, message: bytes, sums_at: int,
                 blocks: Any = None) -> None:
        if message and not MIN_MESSAGE <= len(message) <= MAX_MESSAGE:
            raise ValueError(f"a checksum's input of {len(message)} bytes")
        self.kernels = kernels
        self.mapping = (table, arena, limit)
        """What the words name (the table's and the arena's addresses, the arena's size)."""
        self.source: Any = None
        """The caller's, to tell a plan made for another mapping (a reconnect maps the
        agent's files again)."""
        self.size = size
        self.checked = bool(message)
        """Whether the call checks each chunk's checksum (else: `sums`, for the caller)."""
        self.message = message  # the call reads it: kept alive with the plan
        self.words = array.array("Q", bytes(8 * len(PARAMS)))
        self.address = self.words.buffer_info()[0]
        w, at = self.words, _AT
        w[at["piece"]], w[at["table"]], w[at["mask"]] = kernels.piece, table, mask
        w[at["arena"]], w[at["limit"]], w[at["size"]] = arena, limit, size
        w[at["meta_hash"]], w[at["msglen"]], w[at["sums_at"]] = meta_hash, len(message), sums_at
        w[at["msg"]] = ctypes.cast(ctypes.c_char_p(message), _P).value or 0 if message else 0
        self.blocks = blocks
        self._per_chunk = 0
        if blocks is not None:
            self._bases = array.array("Q", blocks.bases)
            w[at["bases"]], w[at["layers"]] = self._bases.buffer_info()[0], len(blocks.bases)
            w[at["stride"]], w[at["nbytes"]] = blocks.stride, blocks.nbytes
            w[at["per"]], w[at["scratch"]] = blocks.per, blocks.scratch_address
            w[at["blocks"]] = blocks.num_blocks
            self._per_chunk = len(blocks.bases) * blocks.per
        self.capacity = 0
        self.info = array.array("Q")
        """INFO_WORDS a key: its slot's offset (0: not read), first word, arena offset and
        checksum."""
        self.sums = array.array("Q")
        """Two a key: its chunk's S0 and S1."""
        self._ranges = array.array("Q")
        self._starts = array.array("Q")

    def grow(self, n: int) -> None:
        """Buffers for reads of `n` keys at least."""
        n = max(n, 2 * self.capacity)
        self.info = array.array("Q", bytes(8 * INFO_WORDS * n))
        self.sums = array.array("Q", bytes(16 * n))
        w, at = self.words, _AT
        w[at["info"]], w[at["sums"]] = self.info.buffer_info()[0], self.sums.buffer_info()[0]
        if self.blocks is not None:
            self._ranges = array.array("Q", bytes(16 * self._per_chunk * n))
            self._starts = array.array("Q", bytes(8 * (n + 1)))
            w[at["ranges"]] = self._ranges.buffer_info()[0]
            w[at["starts"]] = self._starts.buffer_info()[0]
        self.capacity = n

    def read(self, want: bytes, n: int, ids: int) -> int:
        """The read of the `n` keys `want` into the blocks `ids` (the address of `n` times
        `per` block ids, i64; the first chunk's first `skip` go to scratch): the chunks read,
        -1 for a block id outside the blocks (nothing read). Chunk i was read where
        `info[INFO_WORDS * i]` is not 0."""
        if n > self.capacity:
            self.grow(n)
        return self.kernels.read(self.address, want, n, ids)

    def read_ranges(self, want: bytes, n: int, ranges: int, starts: int) -> int:
        """`read` into destinations given as ranges (`copy`'s `ranges` and `starts`)."""
        if n > self.capacity:
            self.grow(n)
        w = self.words
        w[_AT["ranges"]], w[_AT["starts"]] = ranges, starts
        return self.kernels.read(self.address, want, n, 0)

    def set_skip(self, skip: int) -> None:
        self.words[_AT["skip"]] = skip

    def set_hook(self, hook: int) -> None:
        """A function `read` calls between its table reads and its copies (0: none)."""
        self.words[_AT["hook"]] = hook


_keep: list[Any] = []


def _compile() -> Kernels | None:
    piece = wsumkernel.piece_address()
    if piece is None:
        return None
    try:
        compiled = compile_ir(_IR, ("read", "xxh3_bytes", "cycles"), opt=2)
    except Exception as e:  # a JIT refused (e.g. no executable memory): Python still works
        log.warning("lease-free window read not compiled (%s); it runs in Python", e)
        return None
    if compiled is None or not all(compiled):
        return None
    # read: CFUNCTYPE, which lets the GIL go for the copies (milliseconds), as
    # `wsumkernel.copy_sums` does; digest: a call of microseconds keeps it.
    read = ctypes.CFUNCTYPE(_I, _P, ctypes.c_char_p, _I, _P)(compiled[0])
    digest = ctypes.PYFUNCTYPE(ctypes.c_uint64, _P, _I)(compiled[1])
    cycles = ctypes.PYFUNCTYPE(ctypes.c_uint64)(compiled[2])
    _keep.extend((read, digest, cycles))
    return Kernels(read, digest, piece, cycles)


_compiled = Lazy(_compile, "kvpool-leasefree-jit")
kernels = _compiled.get
"""The compiled calls (compiled once per process, by the first caller), or None."""
ready = _compiled.ready
"""The compiled calls if compiled already, else None (never compiles)."""
compile_soon = _compiled.compile_soon
"""Compile them on a thread of their own, once per process."""
