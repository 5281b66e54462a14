"""LOOKUP's probes of a `KeyTable` for many keys in one call: a loop compiled at run time
by llvmlite (as `wsumkernel`'s).

A LOOKUP of 128 keys probes DRAM's table for each key and, with peers on, the peer
directory's: in Python each probe is a call, a hash, a few array reads and a slice
compared, ~0.4 us a key on a small machine, 128 keys twice ~100 us, more than the round
trip itself. Here the keys' hashes (Python's `hash()`, SipHash seeded per process: what
the table is built with, so a client still cannot aim keys at one probe run) are taken
in Python, and one call walks every key's probe run and compares the keys: a few
microseconds for 128.

- `probe(cells, mask, keys, slots, want, homes, n, out, found)`: for each of the `n`
  keys (16 bytes each at `want`, hashes at `homes`), its slot in the table (`out`, i64,
  -1: absent) and 1 or 0 in `found` (u8). `cells` is the table's i32 cells (0 empty, -1
  a tombstone, else slot + 1), `mask` its size - 1, `keys` its 16-byte keys by slot
  (`slots` of them: a cell past them is taken for a miss).
- `codes(dir_slots, n, peers, npeers, readable, local, code, out)`: the peer tier's
  code per key of a LOOKUP past its local prefix: 2 where `local` (u8) says DRAM holds
  the key, else `code` where the directory's slot (i64) names a peer (u16 `peers` by
  slot) that `readable` (u8 by peer, `npeers` of them) says may be read, else 0.

- `sweep(cells, ncells, column, rows, value, out, room)`: takes out of the table every key
  whose slot's u16 in `column` (`rows` of them) is `value`: its cell becomes a tombstone
  and its slot is written to `out` (i32), at most `room` of them; returns how many. One
  pass over the cells: a peer's entries dropped at once (~35 ms at 10^6 entries on a
  loaded 2-core machine, where the walk in Python took 0.3-1.3 s of the event loop).

- `place(cells, ncells, keys, hash, into, mask)`: a table's rebuild: every key of `cells`
  (slot + 1 > 0; its 16 bytes at `keys` by slot) placed in the empty cells `into` (size
  `mask` + 1) from its `hash()` (CPython's `_Py_HashBytes`, what `hash()` of a `bytes`
  is), by linear probing. A rebuild in Python took ~0.5 s at 5·10^5 keys, on the loop.

- `facts(slots, n, rows, hits, seqs, depths, access, seq, now)`: the DRAM hits of a
  LOOKUP's leading `n` keys (their slots, i64), as `FactRows.hit` of each at its depth
  (its index): one more hit, LOOKUP `seq`, the depth, the time `now` (rows past `rows`
  are left alone).
- `prepare(list, n, ...)`: what the two above start from, for a list of `n` keys: each
  key's `hash()` and its 16 bytes, written in place of `b"".join(keys)` and
  `keytable.homes(keys)` (~15 us of Python for 128 keys), by calling CPython's own C API
  (`PyList_GetItem`, `PyBytes_Size`, `PyObject_Hash`, `PyBytes_AsString`: the same hash
  Python takes); it stops at the first key that is not 16 bytes and returns its index
  (-1: all were).

Called with the GIL held (ctypes' PYFUNCTYPE): the table's arrays cannot change during
the call, and a call is a few microseconds. Where llvmlite is missing or cannot compile,
`kernels` is None and `KeyTable` probes key by key in Python.
"""

from __future__ import annotations

import array
import ctypes
import logging
from collections.abc import Callable
from typing import Any

from .jit import Lazy, compile_ir

log = logging.getLogger(__name__)

_IR = """
define void @probe(ptr %cells, i64 %mask, ptr %keys, i64 %slots, ptr %want, ptr %homes,
                   i64 %n, ptr %out, ptr %found) nounwind {
entry:
  %none = icmp eq i64 %n, 0
  br i1 %none, label %done, label %key
key:
  %i = phi i64 [0, %entry], [%i.n, %next]
  %hp = getelementptr i64, ptr %homes, i64 %i
  %h = load i64, ptr %hp, align 1
  %home = and i64 %h, %mask
  %woff = shl i64 %i, 4
  %wp0 = getelementptr i8, ptr %want, i64 %woff
  %wp1 = getelementptr i8, ptr %wp0, i64 8
  %w0 = load i64, ptr %wp0, align 1
  %w1 = load i64, ptr %wp1, align 1
  br label %walk
walk:
  %at = phi i64 [%home, %key], [%at.n, %step]
  %steps = phi i64 [0, %key], [%steps.n, %step]
  %cp = getelementptr i32, ptr %cells, i64 %at
  %c = load i32, ptr %cp, align 4
  %empty = icmp eq i32 %c, 0
  br i1 %empty, label %miss, label %live
live:
  %held = icmp sgt i32 %c, 0
  br i1 %held, label %slot, label %step
slot:
  %c1 = sub i32 %c, 1
  %s = zext i32 %c1 to i64
  %known = icmp ult i64 %s, %slots
  br i1 %known, label %compare, label %step
compare:
  %koff = shl i64 %s, 4
  %kp0 = getelementptr i8, ptr %keys, i64 %koff
  %kp1 = getelementptr i8, ptr %kp0, i64 8
  %k0 = load i64, ptr %kp0, align 1
  %k1 = load i64, ptr %kp1, align 1
  %e0 = icmp eq i64 %k0, %w0
  %e1 = icmp eq i64 %k1, %w1
  %same = and i1 %e0, %e1
  br i1 %same, label %hit, label %step
step:
  %at.1 = add i64 %at, 1
  %at.n = and i64 %at.1, %mask
  %steps.n = add i64 %steps, 1
  %more = icmp ule i64 %steps.n, %mask
  br i1 %more, label %walk, label %miss
hit:
  %op = getelementptr i64, ptr %out, i64 %i
  store i64 %s, ptr %op, align 1
  %fp = getelementptr i8, ptr %found, i64 %i
  store i8 1, ptr %fp, align 1
  br label %next
miss:
  %op.m = getelementptr i64, ptr %out, i64 %i
  store i64 -1, ptr %op.m, align 1
  %fp.m = getelementptr i8, ptr %found, i64 %i
  store i8 0, ptr %fp.m, align 1
  br label %next
next:
  %i.n = add i64 %i, 1
  %again = icmp ult i64 %i.n, %n
  br i1 %again, label %key, label %done
done:
  ret void
}

define i64 @prepare(ptr %list, i64 %n, ptr %getitem, ptr %size, ptr %hash, ptr %data,
                    ptr %homes, ptr %want) {
entry:
  %none = icmp eq i64 %n, 0
  br i1 %none, label %done, label %key
key:
  %i = phi i64 [0, %entry], [%i.n, %next]
  %item = call ptr %getitem(ptr %list, i64 %i)
  %len = call i64 %size(ptr %item)
  %good = icmp eq i64 %len, 16
  br i1 %good, label %take, label %bad
take:
  %h = call i64 %hash(ptr %item)
  %hp = getelementptr i64, ptr %homes, i64 %i
  store i64 %h, ptr %hp, align 1
  %src = call ptr %data(ptr %item)
  %s1 = getelementptr i8, ptr %src, i64 8
  %k0 = load i64, ptr %src, align 1
  %k1 = load i64, ptr %s1, align 1
  %woff = shl i64 %i, 4
  %w0 = getelementptr i8, ptr %want, i64 %woff
  %w1 = getelementptr i8, ptr %w0, i64 8
  store i64 %k0, ptr %w0, align 1
  store i64 %k1, ptr %w1, align 1
  br label %next
next:
  %i.n = add i64 %i, 1
  %again = icmp ult i64 %i.n, %n
  br i1 %again, label %key, label %done
bad:
  ret i64 %i
done:
  ret i64 -1
}

define void @facts(ptr %slots, i64 %n, i64 %rows, ptr %hits, ptr %seqs, ptr %depths,
                   ptr %access, i64 %seq, double %now) nounwind {
entry:
  %none = icmp eq i64 %n, 0
  br i1 %none, label %done, label %key
key:
  %i = phi i64 [0, %entry], [%i.n, %next]
  %sp = getelementptr i64, ptr %slots, i64 %i
  %s = load i64, ptr %sp, align 1
  %known = icmp ult i64 %s, %rows
  br i1 %known, label %hit, label %next
hit:
  %hp = getelementptr i64, ptr %hits, i64 %s
  %h = load i64, ptr %hp, align 1
  %h.n = add i64 %h, 1
  store i64 %h.n, ptr %hp, align 1
  %qp = getelementptr i64, ptr %seqs, i64 %s
  store i64 %seq, ptr %qp, align 1
  %dp = getelementptr i32, ptr %depths, i64 %s
  %d = trunc i64 %i to i32
  store i32 %d, ptr %dp, align 1
  %ap = getelementptr double, ptr %access, i64 %s
  store double %now, ptr %ap, align 1
  br label %next
next:
  %i.n = add i64 %i, 1
  %again = icmp ult i64 %i.n, %n
  br i1 %again, label %key, label %done
done:
  ret void
}

define i64 @sweep(ptr %cells, i64 %ncells, ptr %column, i64 %rows, i64 %value, ptr %out,
                  i64 %room) nounwind {
entry:
  %none = icmp eq i64 %ncells, 0
  %full0 = icmp eq i64 %room, 0
  %stop0 = or i1 %none, %full0
  br i1 %stop0, label %done, label %cell
cell:
  %i = phi i64 [0, %entry], [%i.n, %next]
  %k = phi i64 [0, %entry], [%k.n, %next]
  %cp = getelementptr i32, ptr %cells, i64 %i
  %c = load i32, ptr %cp, align 4
  %held = icmp sgt i32 %c, 0
  br i1 %held, label %slot, label %next
slot:
  %c1 = sub i32 %c, 1
  %s = zext i32 %c1 to i64
  %known = icmp ult i64 %s, %rows
  br i1 %known, label %compare, label %next
compare:
  %vp = getelementptr i16, ptr %column, i64 %s
  %v16 = load i16, ptr %vp, align 2
  %v = zext i16 %v16 to i64
  %same = icmp eq i64 %v, %value
  br i1 %same, label %take, label %next
take:
  store i32 -1, ptr %cp, align 4
  %op = getelementptr i32, ptr %out, i64 %k
  store i32 %c1, ptr %op, align 4
  %k.t = add i64 %k, 1
  br label %next
next:
  %k.n = phi i64 [%k, %cell], [%k, %slot], [%k, %compare], [%k.t, %take]
  %i.n = add i64 %i, 1
  %more = icmp ult i64 %i.n, %ncells
  %room.left = icmp ult i64 %k.n, %room
  %again = and i1 %more, %room.left
  br i1 %again, label %cell, label %finish
finish:
  ret i64 %k.n
done:
  ret i64 0
}

define void @place(ptr %cells, i64 %ncells, ptr %keys, ptr %hash, ptr %into,
                   i64 %mask) {
entry:
  %none = icmp eq i64 %ncells, 0
  br i1 %none, label %done, label %cell
cell:
  %i = phi i64 [0, %entry], [%i.n, %next]
  %cp = getelementptr i32, ptr %cells, i64 %i
  %c = load i32, ptr %cp, align 4
  %held = icmp sgt i32 %c, 0
  br i1 %held, label %hash.it, label %next
hash.it:
  %c1 = sub i32 %c, 1
  %s = zext i32 %c1 to i64
  %koff = shl i64 %s, 4
  %kp = getelementptr i8, ptr %keys, i64 %koff
  %h = call i64 %hash(ptr %kp, i64 16)
  %home = and i64 %h, %mask
  br label %walk
walk:
  %at = phi i64 [%home, %hash.it], [%at.n, %taken]
  %ap = getelementptr i32, ptr %into, i64 %at
  %a = load i32, ptr %ap, align 4
  %free = icmp eq i32 %a, 0
  br i1 %free, label %put, label %taken
taken:
  %at.1 = add i64 %at, 1
  %at.n = and i64 %at.1, %mask
  br label %walk
put:
  store i32 %c, ptr %ap, align 4
  br label %next
next:
  %i.n = add i64 %i, 1
  %again = icmp ult i64 %i.n, %ncells
  br i1 %again, label %cell, label %done
done:
  ret void
}

define void @codes(ptr %dslots, i64 %n, ptr %peers, i64 %npeers, ptr %readable,
                   ptr %local, i8 %code, ptr %out) nounwind {
entry:
  %none = icmp eq i64 %n, 0
  br i1 %none, label %done, label %key
key:
  %i = phi i64 [0, %entry], [%i.n, %next]
  %lp = getelementptr i8, ptr %local, i64 %i
  %l = load i8, ptr %lp, align 1
  %isl = icmp ne i8 %l, 0
  br i1 %isl, label %dram, label %dir
dir:
  %sp = getelementptr i64, ptr %dslots, i64 %i
  %s = load i64, ptr %sp, align 1
  %has = icmp sge i64 %s, 0
  br i1 %has, label %peer, label %absent
peer:
  %pp = getelementptr i16, ptr %peers, i64 %s
  %p16 = load i16, ptr %pp, align 1
  %p = zext i16 %p16 to i64
  %inr = icmp ult i64 %p, %npeers
  br i1 %inr, label %ready, label %absent
ready:
  %rp = getelementptr i8, ptr %readable, i64 %p
  %r = load i8, ptr %rp, align 1
  %isr = icmp ne i8 %r, 0
  br i1 %isr, label %remote, label %absent
dram:
  %op.d = getelementptr i8, ptr %out, i64 %i
  store i8 2, ptr %op.d, align 1
  br label %next
remote:
  %op.r = getelementptr i8, ptr %out, i64 %i
  store i8 %code, ptr %op.r, align 1
  br label %next
absent:
  %op.a = getelementptr i8, ptr %out, i64 %i
  store i8 0, ptr %op.a, align 1
  br label %next
next:
  %i.n = add i64 %i, 1
  %again = icmp ult i64 %i.n, %n
  br i1 %again, label %key, label %done
done:
  ret void
}
"""

_P = ctypes.c_void_p
_I = ctypes.c_int64
Probe = Callable[..., None]


class Kernels:
    def __init__(self, probe: Probe, codes: Probe, prepare: Callable[..., int],
                 facts: Probe, sweep: Callable[..., int], place: Probe) -> None:
        self.probe = probe
        self.codes = codes
        self.facts = facts
        self.sweep = sweep
        self._place = place
        self._prepare = prepare
        api = ctypes.pythonapi
        # CPython's own C API (the stable ABI), called by the loop with the GIL held.
        self._api = [ctypes.cast(f, ctypes.c_void_p).value for f in (
            api.PyList_GetItem, api.PyBytes_Size, api.PyObject_Hash, api.PyBytes_AsString)]
        # What `hash()` of a `bytes` is (`bytes_hash` caches this function's result); a
        # private name, so where a Python lacks it a rebuild walks in Python.
        hash_bytes = getattr(api, "_Py_HashBytes", None)
        self._hash_bytes = (None if hash_bytes is None
                            else ctypes.cast(hash_bytes, ctypes.c_void_p).value)

    def place(self, cells: int, ncells: int, keys: int, into: int, mask: int) -> bool:
        """`place` (see the module) with `hash()`'s own function for the keys' bytes; False
        (nothing done) where this Python does not export it."""
        if self._hash_bytes is None:
            return False
        self._place(cells, ncells, keys, self._hash_bytes, into, mask)
        return True

    def prepare(self, keys: list[bytes]) -> tuple[bytes, bytes] | None:
        """The keys joined and their `hash()`es as little-endian i64 (`keytable.homes`), in
        one call; None where a key is not 16 bytes (the caller says which)."""
        n = len(keys)
        want = array.array("B", bytes(16 * n))
        homes = array.array("q", bytes(8 * n))
        if self._prepare(keys, n, *self._api, homes.buffer_info()[0],
                         want.buffer_info()[0]) >= 0:
            return None
        return want.tobytes(), homes.tobytes()


_keep: list[Any] = []
"""The ctypes functions over the compiled code, kept with it for the process's life."""


def _compile() -> Kernels | None:
    try:
        compiled = compile_ir(_IR, ("probe", "codes", "prepare", "facts", "sweep", "place"),
                              opt=2)
    except Exception as e:  # a JIT refused (e.g. no executable memory): Python still works
        log.warning("LOOKUP probe kernel not compiled (%s); keys are probed one by one", e)
        return None
    if compiled is None:
        return None
    probe_at, codes_at, prepare_at, facts_at, sweep_at, place_at = compiled
    # PYFUNCTYPE: the GIL stays held, so no thread changes a table during the call.
    probe = ctypes.PYFUNCTYPE(None, _P, _I, _P, _I, _P, _P, _I, _P, _P)(probe_at)
    codes = ctypes.PYFUNCTYPE(None, _P, _I, _P, _I, _P, _P, ctypes.c_uint8, _P)(codes_at)
    prepare = ctypes.PYFUNCTYPE(ctypes.c_int64, ctypes.py_object, _I, _P, _P, _P, _P, _P,
                                _P)(prepare_at)
    facts = ctypes.PYFUNCTYPE(None, _P, _I, _I, _P, _P, _P, _P, _I, ctypes.c_double)(facts_at)
    sweep = ctypes.PYFUNCTYPE(ctypes.c_int64, _P, _I, _P, _I, _I, _P, _I)(sweep_at)
    place = ctypes.PYFUNCTYPE(None, _P, _I, _P, _P, _P, _I)(place_at)
    _keep.extend((probe, codes, prepare, facts, sweep, place))
    return Kernels(probe, codes, prepare, facts, sweep, place)


_compiled = Lazy(_compile, "kvpool-probe-jit")
kernels = _compiled.get
"""The compiled loops (compiled once per process, by the first caller), or None."""
ready = _compiled.ready
"""The compiled loops if compiled already, else None (never compiles)."""
compile_soon = _compiled.compile_soon
"""Compile the loops on a thread of their own, once per process (~0.2 s of CPU)."""

