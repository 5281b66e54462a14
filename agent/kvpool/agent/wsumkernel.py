"""WSUM's word sums at memory speed: a small vector loop compiled at run time by llvmlite.

`kvpool.agent.checksums` defines WSUM: over the chunk's little-endian 32-bit words u_i,
S0 = sum(u_i) and S1 = sum(i * u_i), both modulo 2^64. numpy needs several passes over
the bytes for that (widening casts, a weighted sum), about 0.1-0.3 of XXH3's speed; this
loop reads each byte once and does no multiplication per word, so it runs as fast as
XXH3 (docs/benchmarks.md, "WSUM verification").

How, without a multiplication per word: read the bytes as rows of R_BYTES, each row as
u64 lanes v = u_even + 2^32 * u_odd, and keep four vector accumulators per lane across
the rows r = 0 .. R-1:

    A += v            (the sum of the lane, both words mixed, modulo 2^64)
    H += v >> 32      (the sum of the odd words: exact)
    Q += A            (after R rows: the sum of (R - r) * v)
    QH += H           (the sum of (R - r) * u_odd)

All of it is exact modulo 2^64, so after the last row the loop recovers, per lane, the
even and odd words' sums (A - 2^32 H, H) and their sums weighted by the row index r
(R * sum - (Q - 2^32 QH) - QH), and from those S0 and S1 with each word's index
32 r + 2 lane (+ 1 for the odd word), summed over the lanes.

The loop is LLVM IR with generic vector types, compiled for the CPU it runs on (AVX2 or
AVX-512 on x86-64, NEON on arm64); ctypes calls it without the GIL, so the agent's other
threads run meanwhile. llvmlite is the agent's dependency (numba's code generator, a
well-kept library): no build step, no compiler on the machine. Where llvmlite is missing
(the client's light install) or cannot compile, `row_sums` returns None and
`kvpool.agent.checksums` uses numpy.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

LANES = 16
"""u64 lanes in a row: two <8 x i64> vectors."""
ROW_BYTES = 8 * LANES
"""Bytes the kernel takes at once: the caller hands it whole rows only."""
_PREFETCH_BYTES = 4096
"""How far ahead of the row being summed the loop asks for the bytes, as XXH3 does (a
page: on a chunk no longer in cache, 512 bytes ran at 0.85x XXH3's speed, 4 KiB at 1.0x;
in cache both alike)."""

_VEC = "<8 x i64>"
_HALF = "<" + ", ".join(["i64 32"] * 8) + ">"


def _ir() -> str:
    """`void wsum_rows(ptr bytes, i64 rows, ptr out)`: out[0] = S0, out[1] = S1."""
    names = ("a0", "a1", "h0", "h1", "q0", "q1", "qh0", "qh1")
    phis = "\n".join(f"  %{n} = phi {_VEC} [zeroinitializer, %entry], [%{n}.n, %loop]"
                     for n in names)
    done = "\n".join(f"  %{n}.z = phi {_VEC} [zeroinitializer, %entry], [%{n}.n, %loop]"
                     for n in names)
    # per vector k (lanes 8k .. 8k+7): the even and odd words' sums, their sum `both`, and
    # sum_r r * (even + odd) = rows * both - (Q - 2^32 QH + QH)
    lanes = []
    for k in (0, 1):
        twice = "<" + ", ".join(f"i64 {2 * (8 * k + j)}" for j in range(8)) + ">"
        lanes.append(f"""
  %hs{k} = shl {_VEC} %h{k}.z, {_HALF}
  %even{k} = sub {_VEC} %a{k}.z, %hs{k}
  %both{k} = add {_VEC} %even{k}, %h{k}.z
  %qhs{k} = shl {_VEC} %qh{k}.z, {_HALF}
  %qe{k} = sub {_VEC} %q{k}.z, %qhs{k}
  %qb{k} = add {_VEC} %qe{k}, %qh{k}.z
  %rb{k} = mul {_VEC} %rows.v, %both{k}
  %rw{k} = sub {_VEC} %rb{k}, %qb{k}
  %lw{k} = mul {_VEC} %both{k}, {twice}""")
    return f"""
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
declare i64 @llvm.vector.reduce.add.v8i64({_VEC})

define void @wsum_rows(ptr %p, i64 %rows, ptr %out) nounwind {{
entry:
  %none = icmp eq i64 %rows, 0
  br i1 %none, label %done, label %loop
loop:
  %r = phi i64 [0, %entry], [%r.n, %loop]
{phis}
  %off = mul i64 %r, {ROW_BYTES}
  %p0 = getelementptr i8, ptr %p, i64 %off
  %p1 = getelementptr i8, ptr %p0, i64 64
  %ahead = getelementptr i8, ptr %p0, i64 {_PREFETCH_BYTES}
  call void @llvm.prefetch.p0(ptr %ahead, i32 0, i32 3, i32 1)
  %ahead1 = getelementptr i8, ptr %ahead, i64 64
  call void @llvm.prefetch.p0(ptr %ahead1, i32 0, i32 3, i32 1)
  %v0 = load {_VEC}, ptr %p0, align 1
  %v1 = load {_VEC}, ptr %p1, align 1
  %o0 = lshr {_VEC} %v0, {_HALF}
  %o1 = lshr {_VEC} %v1, {_HALF}
  %a0.n = add {_VEC} %a0, %v0
  %a1.n = add {_VEC} %a1, %v1
  %h0.n = add {_VEC} %h0, %o0
  %h1.n = add {_VEC} %h1, %o1
  %q0.n = add {_VEC} %q0, %a0.n
  %q1.n = add {_VEC} %q1, %a1.n
  %qh0.n = add {_VEC} %qh0, %h0.n
  %qh1.n = add {_VEC} %qh1, %h1.n
  %r.n = add i64 %r, 1
  %more = icmp ult i64 %r.n, %rows
  br i1 %more, label %loop, label %done
done:
{done}
  %rows.1 = insertelement {_VEC} poison, i64 %rows, i64 0
  %rows.v = shufflevector {_VEC} %rows.1, {_VEC} poison, <8 x i32> zeroinitializer
{"".join(lanes)}
  %both = add {_VEC} %both0, %both1
  %s0 = call i64 @llvm.vector.reduce.add.v8i64({_VEC} %both)
  ; S1: word index 32 r + 2 lane (+ 1 for the odd word)
  %rw = add {_VEC} %rw0, %rw1
  %rw32 = shl {_VEC} %rw, <{", ".join(["i64 5"] * 8)}>
  %lw = add {_VEC} %lw0, %lw1
  %odd = add {_VEC} %h0.z, %h1.z
  %w1 = add {_VEC} %rw32, %lw
  %w = add {_VEC} %w1, %odd
  %s1 = call i64 @llvm.vector.reduce.add.v8i64({_VEC} %w)
  store i64 %s0, ptr %out, align 8
  %out1 = getelementptr i8, ptr %out, i64 8
  store i64 %s1, ptr %out1, align 8
  ret void
}}
"""


_Kernel = Callable[[int, int, int], None]
_Out = ctypes.c_uint64 * 2
_lock = threading.Lock()
_kernel: _Kernel | None = None
_tried = False
_keep: list[Any] = []
"""The JIT engine owning the compiled code: it must live as long as the process."""


def _compile() -> _Kernel | None:
    try:
        import llvmlite.binding as llvm
    except ImportError:
        return None
    try:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        target = llvm.Target.from_default_triple()
        machine = target.create_target_machine(
            cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(),
            opt=3, jit=True)
        module = llvm.parse_assembly(_ir())
        module.verify()
        engine = llvm.create_mcjit_compiler(module, machine)
        engine.finalize_object()
        address = engine.get_function_address("wsum_rows")
    except Exception as e:  # a JIT refused (e.g. no executable memory): numpy still works
        log.warning("WSUM kernel not compiled (%s); WSUM sums use numpy", e)
        return None
    _keep.append(engine)
    # ctypes releases the GIL for the call
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p)(address)
    _keep.append(fn)
    return fn


def kernel() -> _Kernel | None:
    """The compiled row loop (compiled once per process), or None without llvmlite."""
    global _kernel, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _kernel = _compile()
                _tried = True
    return _kernel


def row_sums(address: int, rows: int) -> tuple[int, int] | None:
    """(S0, S1) modulo 2^64 of the `rows * ROW_BYTES` bytes at `address` (word indices
    from 0), or None where the kernel is not available."""
    fn = _kernel if _tried else kernel()
    if fn is None:
        return None
    out = _Out()
    fn(address, rows, ctypes.addressof(out))
    return out[0], out[1]
