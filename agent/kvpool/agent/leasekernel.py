"""A lease-free read of a window in two compiled calls: the table reads, the copies with
their sums and the checks after them, with no Python per chunk (`leasefree.read_planned`).

`leasefree.read_window` reads a window without a lease in Python, a few steps a key: the
slot's seqlock read, the target, the copy plan, then after the copy the checksum from the
sums and the slot read again. In an engine's process that Python runs cold (a prefill's
memory traffic evicts the interpreter's code and data between loads): ~0.15 ms of a 2k
load of 7 chunks, 5-7% of it (docs/benchmarks.md, "A load's lease-free read in compiled
calls"). When the caller knows every destination before the read (`HostTargets`: chunks of
one size and metadata into host ranges), the same steps are loops here:

- `locate(base, mask, want, n, size, meta_hash, limit, info)`: for each of the `n` keys
  (16 bytes each at `want`), its DRAM slot read under the seqlock as `lookupindex` reads
  it (the first word, the rest, a fence, the first word again; at most `READ_RETRIES`
  tries); a LIVE slot of the key, of a chunk in one extent inside the arena's `limit`
  bytes, of `size` bytes, metadata hash `meta_hash` and kind WSUM is found: its slot's byte
  offset in the table, its first word (seq | state << 32), the chunk's arena offset and
  checksum go to `info[4 i ..]`; any other key gets 0 at `info[4 i]` (its slot offset,
  never 0 for a slot: the header comes first). Returns the keys found. It holds the GIL
  (a few microseconds).
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
  `info[4 i]`, and last the table's epoch: returns 1 if it is still `epoch`, 0 if the
  table was rebuilt meanwhile (nothing read). It runs without the GIL (ctypes lets it go
  for the copy).

Why the checks are the Python path's: see `leasefree` (the slot retired before its pages
are freed; x86-64's load order; `lookupindex.IndexReader.usable`).

Where llvmlite is missing or cannot compile, `ready()` is None and the window goes through
`leasefree.read_window`'s Python.
"""

from __future__ import annotations

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

_IR = f"""
declare i64 @llvm.bswap.i64(i64)
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
"""

_P = ctypes.c_void_p
_I = ctypes.c_int64


class Kernels:
    def __init__(self, locate: Callable[..., int], copy: Callable[..., int],
                 digest: Callable[..., int], piece: int) -> None:
        self.locate = locate
        """See the module: (base, mask, want, n, size, meta_hash, limit, info) -> found."""
        self._copy = copy
        self._digest = digest
        self._piece = piece

    def copy(self, base: int, arena: int, want: bytes, info: int, n: int, ranges: int,
             starts: int, size: int, epoch: int, sums: int, message: bytes = b"",
             sums_at: int = 0) -> int:
        """See the module: 1 if the table's epoch is still `epoch`, else 0. `message`: the
        WSUM checksum's input with its sums at `sums_at` (zeros there, overwritten with each
        chunk's), MIN_MESSAGE to MAX_MESSAGE bytes: each chunk's checksum is checked here,
        0 at `info[4 i]` where it does not match; empty, the caller checks them."""
        if message and not MIN_MESSAGE <= len(message) <= MAX_MESSAGE:
            raise ValueError(f"a checksum's input of {len(message)} bytes")
        return self._copy(self._piece, base, arena, want, info, n, ranges, starts, size,
                          epoch, sums, message, len(message), sums_at)

    def xxh3(self, data: bytes) -> int:
        """XXH3-64 of `data` (MIN_MESSAGE to MAX_MESSAGE bytes) as the copy call makes it."""
        if not MIN_MESSAGE <= len(data) <= MAX_MESSAGE:
            raise ValueError(f"{len(data)} bytes")
        return self._digest(data, len(data))


_keep: list[Any] = []


def _compile() -> Kernels | None:
    piece = wsumkernel.piece_address()
    if piece is None:
        return None
    try:
        compiled = compile_ir(_IR, ("locate", "copy", "xxh3_bytes"), opt=2)
    except Exception as e:  # a JIT refused (e.g. no executable memory): Python still works
        log.warning("lease-free window read not compiled (%s); it runs in Python", e)
        return None
    if compiled is None or not all(compiled):
        return None
    # locate: PYFUNCTYPE, a call of microseconds keeps the GIL; copy: CFUNCTYPE, which
    # lets the GIL go for the copies (milliseconds), as `wsumkernel.copy_sums` does.
    locate = ctypes.PYFUNCTYPE(_I, _P, _I, _P, _I, _I, ctypes.c_uint64, _I, _P)(compiled[0])
    copy = ctypes.CFUNCTYPE(_I, _P, _P, _P, _P, _P, _I, _P, _P, _I, ctypes.c_uint64,
                            _P, _P, _I, _I)(compiled[1])
    digest = ctypes.PYFUNCTYPE(ctypes.c_uint64, _P, _I)(compiled[2])
    _keep.extend((locate, copy, digest))
    return Kernels(locate, copy, digest, piece)


_compiled = Lazy(_compile, "kvpool-leasefree-jit")
kernels = _compiled.get
"""The compiled calls (compiled once per process, by the first caller), or None."""
ready = _compiled.ready
"""The compiled calls if compiled already, else None (never compiles)."""
compile_soon = _compiled.compile_soon
"""Compile them on a thread of their own, once per process."""
