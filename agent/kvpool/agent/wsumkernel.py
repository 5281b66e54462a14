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

import array
import ctypes
import logging
from collections.abc import Callable, Sequence
from typing import Any

from .jit import Lazy, compile_ir

log = logging.getLogger(__name__)

LANES = 16
"""u64 lanes in a row: two <8 x i64> vectors."""
ROW_BYTES = 8 * LANES
"""Bytes the kernel takes at once: the caller hands it whole rows only."""
_PREFETCH_BYTES = 4096
"""How far ahead of the row being summed the loop asks for the bytes, as XXH3 does (a
page: on a chunk no longer in cache, 512 bytes ran at 0.85x XXH3's speed, 4 KiB at 1.0x;
in cache both alike)."""

PAGE_BYTES = 4096
STREAMS = 4
"""A copy into a 64-byte aligned destination goes in blocks of STREAMS pages, row r of
each page in turn (`_blocks_ir`): four streams of reads and of streaming stores at once,
as glibc's memmove copies large sizes. One stream ran ~15% slower than libc's one-piece
memmove of the same bytes here (26.5 against 22.9 ms for 252 MiB); four ran at its speed
(docs/benchmarks.md, "vLLM's time to first token")."""
BLOCK_BYTES = STREAMS * PAGE_BYTES
assert BLOCK_BYTES == 1 << 14, "wsum_piece shifts by 14 for BLOCK_BYTES"
BLOCK_PREFETCH_BYTES = BLOCK_BYTES
"""How far ahead of each row it copies the block loop asks for the source's bytes: the same
row of the next block's pages. The hardware's prefetchers stop at a page's edge, so without
it each of a block's four pages began with misses (and, on 4 KiB pages, a page walk) that
nothing overlapped; with it, the loop ran 4-7% faster here over 256 MiB, from an agent's
arena (tmpfs pages) as from private memory (docs/benchmarks.md, "The copy loop's read-ahead
across pages"). A prefetch never faults, so the last block's, past the piece's end, is
harmless."""

_VEC = "<8 x i64>"
_HALF = "<" + ", ".join(["i64 32"] * 8) + ">"


def _ir() -> str:
    """`void wsum_rows(ptr bytes, i64 rows, ptr out)`: out[0] = S0, out[1] = S1; and
    `void wsum_copy(ptr pieces, i64 n, ptr out)` (see `copy_sums`)."""
    return (_rows_ir("wsum_rows", copy=False) + _rows_ir("wsum_copy_rows", copy=True)
            + _rows_ir("wsum_stream_rows", copy=True, streaming=True) + _blocks_ir()
            + _COPY_IR)


def _rows_ir(name: str, copy: bool, streaming: bool = False) -> str:
    """The row loop as function `name`; with `copy`, `(ptr src, ptr dst, i64 rows, ptr
    out)`: each row is also stored to `dst` as it is loaded and summed. `streaming`: the
    stores bypass the caches (non-temporal; `dst` must be 64-byte aligned), as libc's
    memcpy does for large copies: a store then costs no read of the line it replaces,
    which nearly halves the memory traffic of a copy larger than the caches."""
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
    how = "align 64, !nontemporal !0" if streaming else "align 1"
    stores = f"""
  %d0 = getelementptr i8, ptr %d, i64 %off
  %d1 = getelementptr i8, ptr %d0, i64 64
  store <8 x i64> %v0, ptr %d0, {how}
  store <8 x i64> %v1, ptr %d1, {how}""" if copy else ""
    head = "" if copy else f"""
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
declare i64 @llvm.vector.reduce.add.v8i64({_VEC})
"""
    args = "ptr %p, ptr %d, i64 %rows, ptr %out" if copy else "ptr %p, i64 %rows, ptr %out"
    return f"""{head}
define void @{name}({args}) nounwind {{
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
  %v1 = load {_VEC}, ptr %p1, align 1{stores}
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


def _splat(value: int) -> str:
    return "<" + ", ".join([f"i64 {value}"] * 8) + ">"


def _blocks_ir() -> str:
    """`void wsum_stream_blocks(ptr src, ptr dst, i64 blocks, ptr out)`: copy `blocks`
    blocks of BLOCK_BYTES with streaming stores (`dst` 64-byte aligned) and store their
    (S0, S1) at out[0], out[1], word indices from `src`; each row's source is asked for
    a block ahead (BLOCK_PREFETCH_BYTES).

    Each step t copies row r of each of the block's STREAMS pages (t = 32 b + r for block
    b, 32 rows a page): the row of page j is the block's row g = 32 j + r, the bytes' row
    128 b + 32 j + r = t + 96 b + 32 j. So a word's index 32 g' + 2 lane (+1 if odd) is
    split in four sums, each kept as `_rows_ir` keeps its own (a lane's u64 sum A and its
    odd words' sum H give the even words' as A - 2^32 H):

    - over the steps, the four rows summed: A, H, and Q, QH (running sums of A, H, so
      sum_t t * x = T * A - Q), as one row of `_rows_ir`;
    - over the pages, sum_j j * row: WA, WH;
    - over the blocks, BQ, BQH: A and H added at each block's end, so sum_b b * x =
      blocks * A - BQ."""
    acc = ("a", "h", "q", "qh", "wa", "wh")
    outer = ("bq", "bqh")
    halves = (0, 1)

    block_phis = "\n".join(
        f"  %{n}{k}.b = phi {_VEC} [zeroinitializer, %entry], [%{n}{k}.n, %blockend]"
        for n in acc for k in halves)
    outer_phis = "\n".join(
        f"  %{n}{k} = phi {_VEC} [zeroinitializer, %entry], [%{n}{k}.n, %blockend]"
        for n in outer for k in halves)
    loop_phis = "\n".join(
        f"  %{n}{k} = phi {_VEC} [%{n}{k}.b, %block], [%{n}{k}.n, %loop]"
        for n in acc for k in halves)
    rows = []
    for j in range(STREAMS):
        for k in halves:
            rows.append(f"""
  %o{j}{k} = add i64 %off, {PAGE_BYTES * j + 64 * k}
  %s{j}{k} = getelementptr i8, ptr %p, i64 %o{j}{k}
  %d{j}{k} = getelementptr i8, ptr %d, i64 %o{j}{k}
  %f{j}{k} = getelementptr i8, ptr %s{j}{k}, i64 {BLOCK_PREFETCH_BYTES}
  call void @llvm.prefetch.p0(ptr %f{j}{k}, i32 0, i32 3, i32 1)
  %v{j}{k} = load {_VEC}, ptr %s{j}{k}, align 1
  store {_VEC} %v{j}{k}, ptr %d{j}{k}, align 64, !nontemporal !0
  %u{j}{k} = lshr {_VEC} %v{j}{k}, {_HALF}""")
    sums = []
    for k in halves:
        for x in ("v", "u"):  # the rows' u64 lanes, their odd words
            sums.append(f"""
  %{x}23{k} = add {_VEC} %{x}2{k}, %{x}3{k}
  %{x}123{k} = add {_VEC} %{x}1{k}, %{x}23{k}
  %{x}all{k} = add {_VEC} %{x}0{k}, %{x}123{k}
  %{x}w.{k} = add {_VEC} %{x}123{k}, %{x}23{k}
  %{x}w{k} = add {_VEC} %{x}w.{k}, %{x}3{k}""")
        sums.append(f"""
  %a{k}.n = add {_VEC} %a{k}, %vall{k}
  %h{k}.n = add {_VEC} %h{k}, %uall{k}
  %q{k}.n = add {_VEC} %q{k}, %a{k}.n
  %qh{k}.n = add {_VEC} %qh{k}, %h{k}.n
  %wa{k}.n = add {_VEC} %wa{k}, %vw{k}
  %wh{k}.n = add {_VEC} %wh{k}, %uw{k}""")
    fold = []
    for k in halves:
        twice = "<" + ", ".join(f"i64 {2 * (8 * k + j)}" for j in range(8)) + ">"

        def both(lo: str, hi: str, name: str, k: int = k) -> str:
            """A lane's even plus odd words from its u64 sum `lo` and odd sum `hi`."""
            return f"""
  %{name}{k}.s = shl {_VEC} %{hi}{k}.n, {_HALF}
  %{name}{k}.e = sub {_VEC} %{lo}{k}.n, %{name}{k}.s
  %{name}{k} = add {_VEC} %{name}{k}.e, %{hi}{k}.n"""
        fold.append(both("a", "h", "both") + both("q", "qh", "qb") + both("bq", "bqh", "bb")
                    + both("wa", "wh", "jw") + f"""
  %rt{k} = mul {_VEC} %steps.v, %both{k}
  %rw{k} = sub {_VEC} %rt{k}, %qb{k}
  %bt{k} = mul {_VEC} %blocks.v, %both{k}
  %bw{k} = sub {_VEC} %bt{k}, %bb{k}
  %bw96.{k} = mul {_VEC} %bw{k}, {_splat(96)}
  %jw32.{k} = shl {_VEC} %jw{k}, {_splat(5)}
  %g1.{k} = add {_VEC} %rw{k}, %bw96.{k}
  %g{k} = add {_VEC} %g1.{k}, %jw32.{k}
  %g32.{k} = shl {_VEC} %g{k}, {_splat(5)}
  %lw{k} = mul {_VEC} %both{k}, {twice}
  %i1.{k} = add {_VEC} %g32.{k}, %lw{k}
  %i{k} = add {_VEC} %i1.{k}, %h{k}.n""")
    steps = PAGE_BYTES // ROW_BYTES
    return f"""
define void @wsum_stream_blocks(ptr %p, ptr %d, i64 %blocks, ptr %out) nounwind {{
entry:
  %none = icmp eq i64 %blocks, 0
  br i1 %none, label %zero, label %block
zero:
  store i64 0, ptr %out, align 8
  %out.z = getelementptr i8, ptr %out, i64 8
  store i64 0, ptr %out.z, align 8
  ret void
block:
  %b = phi i64 [0, %entry], [%b.n, %blockend]
{block_phis}
{outer_phis}
  %boff = mul i64 %b, {BLOCK_BYTES}
  br label %loop
loop:
  %r = phi i64 [0, %block], [%r.n, %loop]
{loop_phis}
  %roff = mul i64 %r, {ROW_BYTES}
  %off = add i64 %boff, %roff{"".join(rows)}{"".join(sums)}
  %r.n = add i64 %r, 1
  %more = icmp ult i64 %r.n, {steps}
  br i1 %more, label %loop, label %blockend
blockend:
  %bq0.n = add {_VEC} %bq0, %a0.n
  %bq1.n = add {_VEC} %bq1, %a1.n
  %bqh0.n = add {_VEC} %bqh0, %h0.n
  %bqh1.n = add {_VEC} %bqh1, %h1.n
  %b.n = add i64 %b, 1
  %mb = icmp ult i64 %b.n, %blocks
  br i1 %mb, label %block, label %done
done:
  %steps = mul i64 %blocks, {steps}
  %steps.1 = insertelement {_VEC} poison, i64 %steps, i64 0
  %steps.v = shufflevector {_VEC} %steps.1, {_VEC} poison, <8 x i32> zeroinitializer
  %blocks.1 = insertelement {_VEC} poison, i64 %blocks, i64 0
  %blocks.v = shufflevector {_VEC} %blocks.1, {_VEC} poison, <8 x i32> zeroinitializer
{"".join(fold)}
  %both = add {_VEC} %both0, %both1
  %s0 = call i64 @llvm.vector.reduce.add.v8i64({_VEC} %both)
  %i = add {_VEC} %i0, %i1
  %s1 = call i64 @llvm.vector.reduce.add.v8i64({_VEC} %i)
  store i64 %s0, ptr %out, align 8
  %out1 = getelementptr i8, ptr %out, i64 8
  store i64 %s1, ptr %out1, align 8
  ret void
}}
"""


_COPY_IR = """
define void @wsum_piece(ptr %src, ptr %dst, i64 %nbytes, ptr %out) nounwind {
entry:
  %more.out = alloca [2 x i64], align 8
  %rows = lshr i64 %nbytes, 7
  %dsti = ptrtoint ptr %dst to i64
  %mis = and i64 %dsti, 63
  %aligned = icmp eq i64 %mis, 0
  br i1 %aligned, label %stream, label %cached
stream:
  ; whole blocks of pages in four streams (BLOCK_BYTES = 2^14), then the rows left in one
  %blocks = lshr i64 %nbytes, 14
  call void @wsum_stream_blocks(ptr %src, ptr %dst, i64 %blocks, ptr %out)
  %skip = shl i64 %blocks, 14
  %block.rows = shl i64 %blocks, 7
  %left = sub i64 %rows, %block.rows
  %src.l = getelementptr i8, ptr %src, i64 %skip
  %dst.l = getelementptr i8, ptr %dst, i64 %skip
  call void @wsum_stream_rows(ptr %src.l, ptr %dst.l, i64 %left, ptr %more.out)
  %m0 = load i64, ptr %more.out, align 8
  %m1.at = getelementptr i8, ptr %more.out, i64 8
  %m1 = load i64, ptr %m1.at, align 8
  %b0 = load i64, ptr %out, align 8
  %b1.at = getelementptr i8, ptr %out, i64 8
  %b1 = load i64, ptr %b1.at, align 8
  %skip.words = shl i64 %blocks, 12
  %m0w = mul i64 %m0, %skip.words
  %c0 = add i64 %b0, %m0
  %c1.m = add i64 %b1, %m1
  %c1 = add i64 %c1.m, %m0w
  store i64 %c0, ptr %out, align 8
  store i64 %c1, ptr %b1.at, align 8
  br label %rest
cached:
  call void @wsum_copy_rows(ptr %src, ptr %dst, i64 %rows, ptr %out)
  br label %rest
rest:
  %first = shl i64 %rows, 5
  %words = lshr i64 %nbytes, 2
  %any = icmp ult i64 %first, %words
  br i1 %any, label %tail, label %done
tail:
  %j = phi i64 [%first, %rest], [%j.n, %tail]
  %t0 = phi i64 [0, %rest], [%t0.n, %tail]
  %t1 = phi i64 [0, %rest], [%t1.n, %tail]
  %off = shl i64 %j, 2
  %ps = getelementptr i8, ptr %src, i64 %off
  %pd = getelementptr i8, ptr %dst, i64 %off
  %w = load i32, ptr %ps, align 1
  store i32 %w, ptr %pd, align 1
  %u = zext i32 %w to i64
  %t0.n = add i64 %t0, %u
  %m = mul i64 %u, %j
  %t1.n = add i64 %t1, %m
  %j.n = add i64 %j, 1
  %more = icmp ult i64 %j.n, %words
  br i1 %more, label %tail, label %fold
fold:
  %s0 = load i64, ptr %out, align 8
  %o1 = getelementptr i8, ptr %out, i64 8
  %s1 = load i64, ptr %o1, align 8
  %s0.n = add i64 %s0, %t0.n
  %s1.n = add i64 %s1, %t1.n
  store i64 %s0.n, ptr %out, align 8
  store i64 %s1.n, ptr %o1, align 8
  br label %done
done:
  ret void
}

define void @wsum_copy(ptr %pieces, i64 %n, ptr %out) nounwind {
entry:
  %none = icmp eq i64 %n, 0
  br i1 %none, label %done, label %loop
loop:
  %i = phi i64 [0, %entry], [%i.n, %loop]
  %at = mul i64 %i, 3
  %ps = getelementptr i64, ptr %pieces, i64 %at
  %pd = getelementptr i64, ptr %ps, i64 1
  %pn = getelementptr i64, ptr %ps, i64 2
  %src = load ptr, ptr %ps, align 8
  %dst = load ptr, ptr %pd, align 8
  %nbytes = load i64, ptr %pn, align 8
  %oat = shl i64 %i, 1
  %o = getelementptr i64, ptr %out, i64 %oat
  call void @wsum_piece(ptr %src, ptr %dst, i64 %nbytes, ptr %o)
  %i.n = add i64 %i, 1
  %more = icmp ult i64 %i.n, %n
  br i1 %more, label %loop, label %done
done:
  ; streaming stores are weakly ordered: visible to every thread before this returns
  fence seq_cst
  ret void
}

!0 = !{i32 1}
"""
"""`wsum_copy`: for each piece i of `n` (three i64 at pieces[3 i]: source address,
destination address, bytes, a multiple of 4), copy its bytes and store its (S0, S1), word
indices from the piece's start, at out[2 i]: a copy and its WSUM sums in one pass over the
bytes, so verifying a read (or summing a write) costs nothing beyond the copy itself."""


_Kernel = Callable[[int, int, int], None]
_Out = ctypes.c_uint64 * 2
_keep: list[Any] = []
"""The ctypes functions over the compiled code, kept with it for the process's life."""


def _compile() -> tuple[_Kernel, _Kernel, int] | None:
    try:
        addresses = compile_ir(_ir(), ("wsum_rows", "wsum_copy", "wsum_piece"), opt=3)
    except Exception as e:  # a JIT refused (e.g. no executable memory): numpy still works
        log.warning("WSUM kernel not compiled (%s); WSUM sums use numpy", e)
        return None
    if addresses is None:
        return None
    if not all(addresses):  # (a function the IR lacks: never call address 0)
        log.warning("WSUM kernel not compiled (a function is missing); WSUM sums use numpy")
        return None
    # ctypes releases the GIL for the call
    fns = [ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p)(a)
           for a in addresses[:2]]
    _keep.extend(fns)
    return fns[0], fns[1], addresses[2]


_compiled = Lazy(_compile, "kvpool-wsum-jit")


def kernel() -> _Kernel | None:
    """The compiled row loop (compiled once per process), or None without llvmlite."""
    compiled = _compiled.get()
    return compiled[0] if compiled is not None else None


def row_sums(address: int, rows: int) -> tuple[int, int] | None:
    """(S0, S1) modulo 2^64 of the `rows * ROW_BYTES` bytes at `address` (word indices
    from 0), or None where the kernel is not available."""
    fn = kernel()
    if fn is None:
        return None
    out = _Out()
    fn(address, rows, ctypes.addressof(out))
    return out[0], out[1]


def copier() -> _Kernel | None:
    """`wsum_copy` (compiled with the row loop), or None without llvmlite."""
    compiled = _compiled.get()
    return compiled[1] if compiled is not None else None


def piece_address() -> int | None:
    """The address of the compiled `void wsum_piece(ptr src, ptr dst, i64 bytes, ptr out)`
    (one piece of `wsum_copy`: its copy, and its (S0, S1) at out[0], out[1]), for other
    compiled loops to call (`leasekernel`); None without llvmlite."""
    compiled = _compiled.get()
    return compiled[2] if compiled is not None else None


def copy_sums(pieces: Sequence[int]) -> list[int] | None:
    """Copy each piece of `pieces` (flat: source address, destination address, bytes, a
    multiple of 4; the caller owns both ranges) and return each piece's S0 and S1 (flat,
    word indices from the piece's start), in one call that runs without the GIL; None,
    copying nothing, where the kernel is not available."""
    fn = copier()
    if fn is None:
        return None
    n = len(pieces) // 3
    if any(n & 3 for n in pieces[2::3]):
        raise ValueError("copy_sums copies whole 32-bit words: a piece's size is a multiple "
                         "of 4")
    desc = array.array("Q", pieces)
    out = array.array("Q", bytes(16 * n))
    if n:
        fn(desc.buffer_info()[0], n, out.buffer_info()[0])
    return out.tolist()
