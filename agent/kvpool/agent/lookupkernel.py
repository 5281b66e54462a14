"""The client's walk of the agent's shared-memory lookup tables (`lookupindex`) for every key
of a LOOKUP in one call: a loop compiled at run time by llvmlite (as `probekernel`'s for
the agent).

In Python a key's walk is a hash, a few slot reads and compares, and the seqlock's checks,
~2 us a key (~0.5 us a key with numpy's passes over the home slots, DRAM only); a LOOKUP
of 128 keys then costs more than the round trip it saves. Here one call hashes each key
(XXH3-64 of its 16 bytes, seed 0: what the tables are laid out by, computed in the loop),
walks its probe run in the DRAM table and, where DRAM lacks it and there is a peer table,
in the peer table, and writes its tier code.

- `upsert`, `place`: the agent's writes of the peer table (a key's slot, a rebuild), so
  that announcing 10^6 remote entries does not cost seconds of the agent's event loop
  (see the IR).
- `walk(base, dmask, peer_at, pmask, want, n, out, code)`: for each of the `n` keys (16
  bytes each at `want`), 2 in `out` where the DRAM table (at `base`, `dmask` + 1 slots)
  holds it LIVE, else `code` where the peer table (at `base + peer_at`, `pmask` + 1
  slots; `peer_at` 0: none) has it HELD by a readable peer of the slot's gen; it returns
  the number of leading keys so answered (the first key that is in neither ends it), or
  -1 where a slot stayed torn (the agent kept writing it): the caller asks the socket.

The seqlock: each slot's first word is read (acquire), then the key's words, a fence,
and the first word again; a slot whose word was odd or changed is read again (at most
`READ_RETRIES` times). On x86-64 these are plain loads in program order (the module's
`IndexReader.usable`). The caller checks the tables' epochs around the call.

Where llvmlite is missing or cannot compile, `ready()` is None and the reader walks in
Python (numpy's passes for DRAM's prefix).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

from .jit import Lazy, compile_ir

log = logging.getLogger(__name__)

COMPILE_FROM = 16
"""A LOOKUP of this many keys starts the compile (~0.2 s of CPU on a thread of its own): a
client that only asks one key at a time pays none."""
READ_RETRIES = 16

# XXH3-64 of 16 bytes, seed 0 (xxhash's XXH3_len_9to16_64b): the two words of its default
# secret that the input is xored with (bytes 24..39 and 40..55 of kSecret, xored pairwise).
_BITFLIP1 = 0x6782737BEA4239B9
_BITFLIP2 = 0xAF56BC3B0996523A
_PRIME_MX1 = 0x165667919E3779F9

_HEADER = 64
_SLOT = 24
_DRAM_SLOT = 64
"""Bytes of a DRAM table slot (`lookupindex.SLOT_BYTES`; a peer slot is `_SLOT`)."""
HELD_WORD = 1 << 48
"""A held peer slot's state in its first word."""
_PEER_TABLE = 64 + 4 * (1 << 16)
"""Bytes from the peer table's start to its first slot (its header, the peers' states)."""


def slot_read(p: str, base: str, at: str, torn: str, good: str,
               fields: tuple[tuple[str, int, str], ...] = ()) -> str:
    """IR reading slot `at` (byte offset from `base`) under the seqlock into %{p}w (its
    first word), %{p}k0 and %{p}k1 (its key), and each of `fields` (name, byte offset in
    the slot, IR type) into %{p}{name}, then branching to `good`, or to `torn` after
    READ_RETRIES torn reads. The block before it is `{p}walk`."""
    geps = "".join(f"\n  %{p}{name}p = getelementptr i8, ptr %{p}ptr, i64 {at_}"
                   for name, at_, _ in fields)
    loads = "".join(f"\n  %{p}{name} = load atomic {ty}, ptr %{p}{name}p monotonic, align 8"
                    for name, _, ty in fields)
    return f"""
  %{p}ptr = getelementptr i8, ptr %{base}, i64 %{at}
  %{p}k0p = getelementptr i8, ptr %{p}ptr, i64 8
  %{p}k1p = getelementptr i8, ptr %{p}ptr, i64 16{geps}
  br label %{p}read
{p}read:
  %{p}tries = phi i64 [0, %{p}walk], [%{p}tries.n, %{p}again]
  %{p}w = load atomic i64, ptr %{p}ptr acquire, align 8
  %{p}k0 = load atomic i64, ptr %{p}k0p monotonic, align 8
  %{p}k1 = load atomic i64, ptr %{p}k1p monotonic, align 8{loads}
  fence acquire
  %{p}w2 = load atomic i64, ptr %{p}ptr monotonic, align 8
  %{p}odd = trunc i64 %{p}w to i1
  %{p}moved = icmp ne i64 %{p}w, %{p}w2
  %{p}bad = or i1 %{p}odd, %{p}moved
  br i1 %{p}bad, label %{p}again, label %{good}
{p}again:
  %{p}tries.n = add i64 %{p}tries, 1
  %{p}give = icmp uge i64 %{p}tries.n, {READ_RETRIES}
  br i1 %{p}give, label %{torn}, label %{p}read
"""


XXH3_IR = f"""
define internal i64 @xxh3(i64 %k0, i64 %k1) alwaysinline nounwind {{
  %lo = xor i64 %k0, {_BITFLIP1}
  %hi = xor i64 %k1, {_BITFLIP2}
  %lo.w = zext i64 %lo to i128
  %hi.w = zext i64 %hi to i128
  %prod = mul i128 %lo.w, %hi.w
  %prod.lo = trunc i128 %prod to i64
  %prod.sh = lshr i128 %prod, 64
  %prod.hi = trunc i128 %prod.sh to i64
  %fold = xor i64 %prod.lo, %prod.hi
  %swapped = call i64 @llvm.bswap.i64(i64 %lo)
  %acc.1 = add i64 %swapped, 16
  %acc.2 = add i64 %acc.1, %hi
  %acc = add i64 %acc.2, %fold
  %av.1 = lshr i64 %acc, 37
  %av.2 = xor i64 %acc, %av.1
  %av.3 = mul i64 %av.2, {_PRIME_MX1}
  %av.4 = lshr i64 %av.3, 32
  %h = xor i64 %av.3, %av.4
  ret i64 %h
}}
"""
"""`i64 @xxh3(i64 k0, i64 k1)`: XXH3-64 (seed 0) of a 16-byte key as two little-endian words,
what the tables are laid out by: IR shared with the other kernels that walk them
(`leasekernel`)."""


_IR = f"""
declare i64 @llvm.bswap.i64(i64)

{XXH3_IR}
; The agent's side of the peer table (`lookupindex.PeerIndex`): a slot written under its
; seqlock (first word odd, the key, the first word even and changed), every word one store.
define internal void @write_slot(ptr %p, i64 %word, i64 %k0, i64 %k1) alwaysinline nounwind {{
  %old = load atomic i64, ptr %p monotonic, align 8
  %seq = and i64 %old, 65535
  %seq.1 = add i64 %seq, 1
  %seq.odd = and i64 %seq.1, 65535
  %kept = and i64 %old, -65536
  %odd = or i64 %kept, %seq.odd
  store atomic i64 %odd, ptr %p monotonic, align 8
  fence release
  %k0p = getelementptr i8, ptr %p, i64 8
  %k1p = getelementptr i8, ptr %p, i64 16
  store atomic i64 %k0, ptr %k0p monotonic, align 8
  store atomic i64 %k1, ptr %k1p monotonic, align 8
  %seq.2 = add i64 %seq, 2
  %seq.even = and i64 %seq.2, 65535
  %new = or i64 %word, %seq.even
  store atomic i64 %new, ptr %p release, align 8
  ret void
}}

; upsert(table, mask, gens, key, word, remove, room): write `word` (its seq bits 0) and
; the key into the key's slot, else (not `remove`) into the first reusable slot on its
; path (a tombstone, or held by a gen its peer has left: `gens`, u16 by peer), else into
; the EMPTY slot ending it where `room`. Returns 0 (written over a used slot), 1 (into an
; EMPTY one), 2 (no slot: the caller rebuilds), 3 (`remove` of a key not there).
define i64 @upsert(ptr %table, i64 %mask, ptr %gens, ptr %key, i64 %word, i64 %remove,
                   i64 %room) nounwind {{
entry:
  %kp1 = getelementptr i8, ptr %key, i64 8
  %k0 = load i64, ptr %key, align 1
  %k1 = load i64, ptr %kp1, align 1
  %h = call i64 @xxh3(i64 %k0, i64 %k1)
  %home = and i64 %h, %mask
  %removing = icmp ne i64 %remove, 0
  br label %walk
walk:
  %at = phi i64 [%home, %entry], [%at.n, %next]
  %steps = phi i64 [0, %entry], [%steps.n, %next]
  %free = phi i64 [-1, %entry], [%free.n, %next]
  %off = mul i64 %at, {_SLOT}
  %p = getelementptr i8, ptr %table, i64 %off
  %w = load i64, ptr %p, align 8
  %state = lshr i64 %w, 48
  %empty = icmp eq i64 %state, 0
  br i1 %empty, label %atempty, label %used
used:
  %sk0p = getelementptr i8, ptr %p, i64 8
  %sk1p = getelementptr i8, ptr %p, i64 16
  %sk0 = load i64, ptr %sk0p, align 8
  %sk1 = load i64, ptr %sk1p, align 8
  %e0 = icmp eq i64 %sk0, %k0
  %e1 = icmp eq i64 %sk1, %k1
  %same = and i1 %e0, %e1
  %held = icmp eq i64 %state, 1
  %mine = and i1 %held, %same
  br i1 %mine, label %found, label %other
found:
  call void @write_slot(ptr %p, i64 %word, i64 %k0, i64 %k1)
  ret i64 0
other:
  %peer.s = lshr i64 %w, 32
  %peer = and i64 %peer.s, 65535
  %gen.s = lshr i64 %w, 16
  %gen = and i64 %gen.s, 65535
  %gp = getelementptr i16, ptr %gens, i64 %peer
  %g16 = load i16, ptr %gp, align 2
  %g = zext i16 %g16 to i64
  %stale = icmp ne i64 %g, %gen
  %notheld = xor i1 %held, true
  %reusable = or i1 %notheld, %stale
  %nofree = icmp slt i64 %free, 0
  %take = and i1 %reusable, %nofree
  %free.n = select i1 %take, i64 %at, i64 %free
  br label %next
next:
  %at.1 = add i64 %at, 1
  %at.n = and i64 %at.1, %mask
  %steps.n = add i64 %steps, 1
  %more = icmp ule i64 %steps.n, %mask
  br i1 %more, label %walk, label %exhausted
exhausted:
  br i1 %removing, label %absent, label %reuse.x
reuse.x:
  %hasfree.x = icmp sge i64 %free.n, 0
  br i1 %hasfree.x, label %intofree.x, label %full
intofree.x:
  %fo.x = mul i64 %free.n, {_SLOT}
  %fp.x = getelementptr i8, ptr %table, i64 %fo.x
  call void @write_slot(ptr %fp.x, i64 %word, i64 %k0, i64 %k1)
  ret i64 0
atempty:
  br i1 %removing, label %absent, label %reuse
reuse:
  %hasfree = icmp sge i64 %free, 0
  br i1 %hasfree, label %intofree, label %fresh
intofree:
  %fo = mul i64 %free, {_SLOT}
  %fp = getelementptr i8, ptr %table, i64 %fo
  call void @write_slot(ptr %fp, i64 %word, i64 %k0, i64 %k1)
  ret i64 0
fresh:
  %hasroom = icmp ne i64 %room, 0
  br i1 %hasroom, label %intoempty, label %full
intoempty:
  call void @write_slot(ptr %p, i64 %word, i64 %k0, i64 %k1)
  ret i64 1
full:
  ret i64 2
absent:
  ret i64 3
}}

; place(table, mask, cells, ncells, keys, peers, gens): every key of a `KeyTable` (its
; `ncells` i32 cells: 0 empty, -1 a tombstone, else slot + 1; its keys, 16 bytes by slot;
; the peer of each, u16 by slot) held by its peer at the peer's gen (u16 by peer), into
; an empty table (a rebuild), straight from the directory's own arrays.
define void @place(ptr %table, i64 %mask, ptr %cells, i64 %ncells, ptr %keys, ptr %peers,
                   ptr %gens) nounwind {{
entry:
  %none = icmp eq i64 %ncells, 0
  br i1 %none, label %done, label %cell
cell:
  %c = phi i64 [0, %entry], [%c.n, %next]
  %cp = getelementptr i32, ptr %cells, i64 %c
  %cv = load i32, ptr %cp, align 4
  %live = icmp sgt i32 %cv, 0
  br i1 %live, label %key, label %next
key:
  %cv.1 = sub i32 %cv, 1
  %slot = zext i32 %cv.1 to i64
  %ko = shl i64 %slot, 4
  %kp0 = getelementptr i8, ptr %keys, i64 %ko
  %kp1 = getelementptr i8, ptr %kp0, i64 8
  %k0 = load i64, ptr %kp0, align 1
  %k1 = load i64, ptr %kp1, align 1
  %h = call i64 @xxh3(i64 %k0, i64 %k1)
  %home = and i64 %h, %mask
  br label %walk
walk:
  %at = phi i64 [%home, %key], [%at.n, %step]
  %off = mul i64 %at, {_SLOT}
  %p = getelementptr i8, ptr %table, i64 %off
  %w = load i64, ptr %p, align 8
  %free = icmp eq i64 %w, 0
  br i1 %free, label %put, label %step
step:
  %at.1 = add i64 %at, 1
  %at.n = and i64 %at.1, %mask
  br label %walk
put:
  %pp = getelementptr i16, ptr %peers, i64 %slot
  %peer16 = load i16, ptr %pp, align 2
  %peer = zext i16 %peer16 to i64
  %gp = getelementptr i16, ptr %gens, i64 %peer
  %g16 = load i16, ptr %gp, align 2
  %g = zext i16 %g16 to i64
  %gs = shl i64 %g, 16
  %ps = shl i64 %peer, 32
  %w.1 = or i64 %gs, %ps
  %word = or i64 %w.1, {HELD_WORD}
  store i64 %word, ptr %p, align 8
  %sk0p = getelementptr i8, ptr %p, i64 8
  %sk1p = getelementptr i8, ptr %p, i64 16
  store i64 %k0, ptr %sk0p, align 8
  store i64 %k1, ptr %sk1p, align 8
  br label %next
next:
  %c.n = add i64 %c, 1
  %again = icmp ult i64 %c.n, %ncells
  br i1 %again, label %cell, label %done
done:
  ret void
}}

define i64 @walk(ptr %base, i64 %dmask, i64 %peer_at, i64 %pmask, ptr %want, i64 %n,
                 ptr %out, i8 %code) nounwind {{
entry:
  %none = icmp eq i64 %n, 0
  %ptab.0 = add i64 %peer_at, {_PEER_TABLE}
  %pstates = getelementptr i8, ptr %base, i64 %peer_at
  %ptab = getelementptr i8, ptr %base, i64 %ptab.0
  br i1 %none, label %done, label %key
key:
  %i = phi i64 [0, %entry], [%i.n, %next]
  %wo = shl i64 %i, 4
  %wp0 = getelementptr i8, ptr %want, i64 %wo
  %wp1 = getelementptr i8, ptr %wp0, i64 8
  %k0 = load i64, ptr %wp0, align 1
  %k1 = load i64, ptr %wp1, align 1
  %h = call i64 @xxh3(i64 %k0, i64 %k1)
  %dhome = and i64 %h, %dmask
  br label %dwalk
dwalk:
  %dat = phi i64 [%dhome, %key], [%dat.n, %dnext]
  %dsteps = phi i64 [0, %key], [%dsteps.n, %dnext]
  %doff.0 = mul i64 %dat, {_DRAM_SLOT}
  %doff = add i64 %doff.0, {_HEADER}
{slot_read("d", "base", "doff", "torn", "dgood")}
dgood:
  %dstate = lshr i64 %dw, 32
  %dempty = icmp eq i64 %dstate, 0
  br i1 %dempty, label %notdram, label %dlive
dlive:
  %dislive = icmp eq i64 %dstate, 1
  %de0 = icmp eq i64 %dk0, %k0
  %de1 = icmp eq i64 %dk1, %k1
  %dsame = and i1 %de0, %de1
  %dhit = and i1 %dislive, %dsame
  br i1 %dhit, label %dram, label %dnext
dnext:
  %dat.1 = add i64 %dat, 1
  %dat.n = and i64 %dat.1, %dmask
  %dsteps.n = add i64 %dsteps, 1
  %dmore = icmp ule i64 %dsteps.n, %dmask
  br i1 %dmore, label %dwalk, label %notdram
dram:
  %op.d = getelementptr i8, ptr %out, i64 %i
  store i8 2, ptr %op.d, align 1
  br label %next
notdram:
  %nopeer = icmp eq i64 %peer_at, 0
  br i1 %nopeer, label %stop, label %pkey
pkey:
  %phome = and i64 %h, %pmask
  br label %pwalk
pwalk:
  %pat = phi i64 [%phome, %pkey], [%pat.n, %pnext]
  %psteps = phi i64 [0, %pkey], [%psteps.n, %pnext]
  %poff = mul i64 %pat, {_SLOT}
{slot_read("p", "ptab", "poff", "torn", "pgood")}
pgood:
  %pstate = lshr i64 %pw, 48
  %pempty = icmp eq i64 %pstate, 0
  br i1 %pempty, label %stop, label %plive
plive:
  %pisheld = icmp eq i64 %pstate, 1
  %pe0 = icmp eq i64 %pk0, %k0
  %pe1 = icmp eq i64 %pk1, %k1
  %psame = and i1 %pe0, %pe1
  %phit = and i1 %pisheld, %psame
  br i1 %phit, label %pheld, label %pnext
pnext:
  %pat.1 = add i64 %pat, 1
  %pat.n = and i64 %pat.1, %pmask
  %psteps.n = add i64 %psteps, 1
  %pmore = icmp ule i64 %psteps.n, %pmask
  br i1 %pmore, label %pwalk, label %stop
pheld:
  %peer.s = lshr i64 %pw, 32
  %peer = and i64 %peer.s, 65535
  %gen.s = lshr i64 %pw, 16
  %gen = and i64 %gen.s, 65535
  %soff.0 = shl i64 %peer, 2
  %soff = add i64 %soff.0, 64
  %sp = getelementptr i8, ptr %pstates, i64 %soff
  %st.32 = load atomic i32, ptr %sp monotonic, align 4
  %st = zext i32 %st.32 to i64
  %sgen = and i64 %st, 65535
  %sread = and i64 %st, 65536
  %genok = icmp eq i64 %sgen, %gen
  %readok = icmp ne i64 %sread, 0
  %ok = and i1 %genok, %readok
  br i1 %ok, label %remote, label %stop
remote:
  %op.r = getelementptr i8, ptr %out, i64 %i
  store i8 %code, ptr %op.r, align 1
  br label %next
next:
  %i.n = add i64 %i, 1
  %again = icmp ult i64 %i.n, %n
  br i1 %again, label %key, label %done
stop:
  ret i64 %i
torn:
  ret i64 -1
done:
  ret i64 %n
}}
"""

_P = ctypes.c_void_p
_I = ctypes.c_int64


class Kernels:
    def __init__(self, walk: Callable[..., int], upsert: Callable[..., int],
                 place: Callable[..., None]) -> None:
        self._walk = walk
        self.upsert = upsert
        """See the IR: (table, mask, gens, key, word, remove, room) -> 0..3."""
        self.place = place
        """See the IR: (table, mask, cells, ncells, keys, peers, gens)."""

    def walk(self, base: int, dmask: int, peer_at: int, pmask: int, want: bytes, n: int,
             out: bytearray, code: int) -> int:
        """See the module: the leading keys answered (their codes in `out`), or -1."""
        if len(out) < n or len(want) < 16 * n:
            raise ValueError("walk: `out` or `want` too short for the keys")
        target = (ctypes.c_char * len(out)).from_buffer(out)
        try:
            return self._walk(base, dmask, peer_at, pmask, want, n, target, code)
        finally:
            del target



_keep: list[Any] = []


def _compile() -> Kernels | None:
    try:
        compiled = compile_ir(_IR, ("walk", "upsert", "place"), opt=2)
    except Exception as e:  # a JIT refused (e.g. no executable memory): Python still works
        log.warning("lookup walk not compiled (%s); local LOOKUPs walk in Python", e)
        return None
    if compiled is None:
        return None
    if not all(compiled):  # (a function the IR lacks: never call address 0)
        log.warning("lookup walk not compiled (a function is missing); Python walks")
        return None
    # PYFUNCTYPE: no GIL release and re-take around a call of a few microseconds.
    walk = ctypes.PYFUNCTYPE(_I, _P, _I, _I, _I, _P, _I, _P, ctypes.c_uint8)(compiled[0])
    upsert = ctypes.PYFUNCTYPE(_I, _P, _I, _P, _P, ctypes.c_uint64, _I, _I)(compiled[1])
    place = ctypes.PYFUNCTYPE(None, _P, _I, _P, _I, _P, _P, _P)(compiled[2])
    _keep.extend((walk, upsert, place))
    return Kernels(walk, upsert, place)


_compiled = Lazy(_compile, "kvpool-lookup-jit")
kernels = _compiled.get
"""The compiled loops (compiled once per process, by the first caller), or None."""
ready = _compiled.ready
"""The compiled loops if compiled already, else None (never compiles)."""
compile_soon = _compiled.compile_soon
"""Compile the loops on a thread of their own, once per process (~0.2 s of CPU)."""

