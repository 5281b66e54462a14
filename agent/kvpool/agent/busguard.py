"""A SIGBUS guard over the arena's mapping: a load from a page of it that a client took away
(by shrinking the arena file through its own fd) is answered with a zero page and counted,
instead of ending the agent.

Why: a peer read is received straight into the arena's mapping by `recv` (the kernel's
copy: a page past a shrunk file is EFAULT there, never a signal) and its checksum is taken
by reading the same bytes back from the mapping while they are in cache. Received into a
buffer of the agent's own first, the bytes cost a second copy into the arena
(`process_vm_writev`, the kernel pinning each page of the mapping per call): about a fifth
of the reading agent's CPU at 1 MiB chunks (docs/benchmarks.md, "The peer tier between two
nodes"). The checksum's read is the agent's only load from its own mapping, and a load
from a page past the file's end is SIGBUS: the guard makes it a counted zero page.

The handler (LLVM IR compiled by llvmlite, `kvpool.agent.jit`; it runs no Python) looks
at the faulting address: inside a guarded range, it maps an anonymous zero page over the
faulting page (the load then reads zeros) and counts the fault (`faults`); elsewhere it
puts back the action it replaced and returns, so the fault happens again under that
action (the default: the process ends, as without the guard). A reader compares the count
before and after it reads (`recvkernel`): a read the guard answered, or that ran while a
zero page was in the mapping, is not trusted, whatever its checksum says. The arena then
puts its file back to its size and maps the file over the whole range again
(`Arena.repair`), which counts as `repairs`; reads start only while the two counts agree.

Only ranges of 4 KiB pages are guarded (an arena on huge pages keeps the copy through
`process_vm_writev`: a 4 KiB page cannot be mapped inside a huge-page mapping), only on
64-bit Linux on x86-64 or AArch64 (the `siginfo_t` and `struct sigaction` layouts the
code assumes), and only where llvmlite compiles the handler; elsewhere `guard()` is None
and nothing is guarded.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import platform
import signal
import sys
import threading
from collections.abc import Callable

from .jit import Lazy, compile_ir

log = logging.getLogger(__name__)

MAX_RANGES = 16
"""Ranges one process guards at most (an agent has one arena)."""
# state slots (i64)
_FAULTS, _REPAIRS, _USED, _MMAP, _SIGACTION, _OLD = range(6)
_RANGES = 6
_SLOTS = _RANGES + 2 * MAX_RANGES
_SIGACTION_BYTES = 152
"""glibc's `struct sigaction` on 64-bit Linux: the handler, a 128-byte mask, the flags
(int, padded), the restorer."""
_SA_FLAGS_AT = 136
_SA_SIGINFO, _SA_ONSTACK = 4, 0x08000000
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_ZERO_PAGE_FLAGS = mmap.MAP_PRIVATE | 0x10 | mmap.MAP_ANONYMOUS  # MAP_FIXED
_PAGE = mmap.PAGESIZE


def _ir(state: int) -> str:
    """The handler, with the guard's state array at `state` (its address, fixed for the
    process's life)."""
    return f"""
define void @on_sigbus(i32 %sig, ptr %info, ptr %uc) {{
entry:
  %st = inttoptr i64 {state} to ptr
  %ap = getelementptr i8, ptr %info, i64 16
  %addr = load i64, ptr %ap, align 8
  %np = getelementptr i64, ptr %st, i64 {_USED}
  %n = load atomic i64, ptr %np acquire, align 8
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%i.n, %next]
  %more = icmp ult i64 %i, %n
  br i1 %more, label %check, label %chain
check:
  %k = shl i64 %i, 1
  %k.r = add i64 %k, {_RANGES}
  %sp = getelementptr i64, ptr %st, i64 %k.r
  %start = load i64, ptr %sp, align 8
  %ep = getelementptr i64, ptr %sp, i64 1
  %end = load i64, ptr %ep, align 8
  %ge = icmp uge i64 %addr, %start
  %lt = icmp ult i64 %addr, %end
  %in = and i1 %ge, %lt
  br i1 %in, label %zero, label %next
next:
  %i.n = add i64 %i, 1
  br label %loop
zero:
  %page = and i64 %addr, {-_PAGE}
  %pp = inttoptr i64 %page to ptr
  %mp = getelementptr i64, ptr %st, i64 {_MMAP}
  %mm = load ptr, ptr %mp, align 8
  %r = call ptr %mm(ptr %pp, i64 {_PAGE}, i32 {_PROT_RW}, i32 {_ZERO_PAGE_FLAGS}, i32 -1, i64 0)
  %ri = ptrtoint ptr %r to i64
  %mapped = icmp eq i64 %ri, %page
  br i1 %mapped, label %counted, label %chain
counted:
  %f = atomicrmw add ptr %st, i64 1 seq_cst
  ret void
chain:
  %sap = getelementptr i64, ptr %st, i64 {_SIGACTION}
  %sa = load ptr, ptr %sap, align 8
  %oldp = getelementptr i64, ptr %st, i64 {_OLD}
  %old = load ptr, ptr %oldp, align 8
  %x = call i32 %sa(i32 {int(signal.SIGBUS)}, ptr %old, ptr null)
  ret void
}}
"""


class Guard:
    """The installed handler and its state: the guarded ranges and the two counts."""

    def __init__(self, state: ctypes.Array[ctypes.c_int64], old: ctypes.Array[ctypes.c_char]
                 ) -> None:
        self._state = state
        self._old = old
        self.counts_at: int = ctypes.addressof(state)
        """The address of the two counts (faults, then repairs), which the compiled
        receive reads."""
        self._lock = threading.Lock()
        self._remaps: dict[int, Callable[[], None]] = {}
        """Per guarded range (by its start): what maps its file over it again."""

    @property
    def faults(self) -> int:
        return int(self._state[_FAULTS])

    @property
    def repairs(self) -> int:
        return int(self._state[_REPAIRS])

    def clean(self) -> bool:
        """No fault is waiting for its repair."""
        return self._state[_FAULTS] == self._state[_REPAIRS]

    def add(self, start: int, size: int, remap: Callable[[], None]) -> bool:
        """Guard the mapping [start, start + size); `remap` maps its file over it again (a
        repair). False when the table is full."""
        with self._lock:
            state = self._state
            used = int(state[_USED])
            free = [i for i in range(used) if state[_RANGES + 2 * i + 1] == 0]
            i = free[0] if free else used
            if i >= MAX_RANGES:
                return False
            state[_RANGES + 2 * i] = start
            state[_RANGES + 2 * i + 1] = start + size
            if i == used:
                state[_USED] = used + 1  # published last: the handler reads up to it
            self._remaps[start] = remap
        return True

    def remove(self, start: int) -> None:
        """Stop guarding the range at `start` (its mapping is going: the addresses may be
        mapped again, by anything)."""
        with self._lock:
            state = self._state
            for i in range(int(state[_USED])):
                if state[_RANGES + 2 * i] == start and state[_RANGES + 2 * i + 1]:
                    state[_RANGES + 2 * i + 1] = 0  # empty: the handler's test fails
                    state[_RANGES + 2 * i] = 0
            self._remaps.pop(start, None)

    def repair(self) -> None:
        """Every zero page the handler mapped replaced by the file again: each guarded
        range's `remap` (the arena puts its file back to its size first), then the faults
        counted so far count as repaired. Nothing to do while no fault waits."""
        if self.clean():
            return
        with self._lock:
            faults = int(self._state[_FAULTS])
            if faults == self._state[_REPAIRS]:
                return
            for remap in list(self._remaps.values()):
                remap()
            self._state[_REPAIRS] = faults


def _build() -> Guard | None:
    if (sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64")
            or ctypes.sizeof(ctypes.c_void_p) != 8):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    state = (ctypes.c_int64 * _SLOTS)()
    old = (ctypes.c_char * _SIGACTION_BYTES)()
    new = (ctypes.c_char * _SIGACTION_BYTES)()
    state[_MMAP] = ctypes.cast(libc.mmap, ctypes.c_void_p).value or 0
    state[_SIGACTION] = ctypes.cast(libc.sigaction, ctypes.c_void_p).value or 0
    state[_OLD] = ctypes.addressof(old)
    try:
        compiled = compile_ir(_ir(ctypes.addressof(state)), ("on_sigbus",), opt=2)
    except Exception as e:  # a JIT refused: nothing is guarded, reads copy as before
        log.warning("arena SIGBUS guard not compiled (%s)", e)
        return None
    if compiled is None:
        return None
    ctypes.c_void_p.from_buffer(new, 0).value = compiled[0]
    ctypes.c_int.from_buffer(new, _SA_FLAGS_AT).value = _SA_SIGINFO | _SA_ONSTACK
    sigaction = libc.sigaction
    sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    sigaction.restype = ctypes.c_int
    if sigaction(int(signal.SIGBUS), ctypes.addressof(new), ctypes.addressof(old)) != 0:
        log.warning("arena SIGBUS guard not installed: %s", ctypes.get_errno())
        return None
    guard = Guard(state, old)
    _keep.append((state, old, new, guard))
    return guard


_keep: list[object] = []
"""What the installed handler refers to, kept for the process's life."""

_guard = Lazy(_build, "kvpool-busguard-jit")
guard = _guard.get
"""The installed guard (compiled and installed once per process, by the first caller), or
None where it cannot be."""
ready = _guard.ready
"""The guard if installed already, else None (never compiles)."""
