"""Reads of DRAM chunks without a lease: optimistic copies, validated after the fact.

A read under a lease costs a round trip to the agent (ACQUIRE), and on a busy machine the
agent's answer is the largest fixed cost of a small read: the agent must wake and get a
core (docs/benchmarks.md, "The load's fixed costs, phase by phase"). The lookup index the
agent publishes in shared memory (`lookupindex`) also says where each chunk of one extent
lies in the arena and what its checksum is, so a client reads it the way one-sided RDMA
key-value stores do (FaRM, Pilaf): read the slot, copy the bytes, check them, read the
slot again.

For each key of a window:

1. the table's epoch (even: not being rebuilt), then the key's LIVE slot under its seqlock:
   seq, offset, size, checksum and its kind, and the XXH3-64 of the chunk's metadata;
2. the metadata itself from what this client has seen (`Metas`: the metadata of its own
   puts and of the chunks the agent described to it); one it has not seen goes to the
   socket;
3. the copy into the caller's destination, with the checksum over the copied bytes and
   that metadata (the same copy-and-sum loop as a leased read's, `hostcopy`);
4. the slot and the epoch again (`IndexReader.unchanged`): the same seq, key and epoch.

A key that passes both checks is read; every other one (not in the table, several extents,
metadata not known, a destination that is not host memory, a checksum mismatch, a slot
that changed) goes through the ACQUIRE window as before, which copies and checks it again
under a lease (a mismatch there is a miss, as always). Why the bytes are the chunk's:
the agent retires a slot (its seq changes) before the chunk's pages can be freed, and
pages are handed to another chunk only after they are freed, so a copy that read any
byte of another chunk's was made after the retirement and its second read of the slot
sees the new seq (x86-64 keeps loads in order and stores in order; docs/protocol.md,
"Reads without a lease"). The checksum catches the rest: bytes a client of the tenant
overwrote in place, a copy torn by a writer.

The agent still hears of each read: the keys go in one told READ with the client's next
write (not waited for), so the chunks' place in the eviction order, the tier's read
bytes and a hand-off's first read are as for an ACQUIRE.

Copies into host memory only (buffers and `HostRanges`): a destination that is a tensor
goes through the lease (a device copy completes later, after the slot's second read).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

from xxhash import xxh3_64_intdigest

from . import leasekernel
from . import protocol as p
from .checksums import wsum_finish_many, wsum_message
from .constants import KEY_BYTES
from .hostcopy import BlockTargets, HostBlocks, HostRanges, HostTargets
from .lookupindex import IndexReader, Where
from .transport import BufferCopies, Check, ReadTarget

MAX_METAS = 256
"""Distinct metadata a client remembers (an engine has one per KV layout): past it, the
memory starts again (a read of an unknown one asks the socket, which teaches it again)."""


class Metas:
    """The metadata this client has seen, by XXH3-64: what a slot's `meta_hash` names.

    A lease-free read needs the chunk's metadata to check the checksum and to give the
    caller's target; the table carries only its hash. The checksum covers the metadata,
    so a hash collision (or a hostile writer) cannot make a read pass with the wrong one."""

    def __init__(self) -> None:
        self._by_hash: dict[int, bytes] = {xxh3_64_intdigest(b""): b""}
        self._last: bytes | None = None

    def learn(self, meta: bytes) -> None:
        if meta is self._last:
            return  # (an engine's connector tells the same one before every load)
        self._last = meta
        h = xxh3_64_intdigest(meta)
        if h in self._by_hash:
            return
        if len(self._by_hash) >= MAX_METAS:
            self._by_hash = {xxh3_64_intdigest(b""): b""}
        self._by_hash[h] = bytes(meta)

    def get(self, meta_hash: int) -> bytes | None:
        return self._by_hash.get(meta_hash)


Remembered = dict[int, tuple[int, bytes, Any]]
"""Window index -> (size, meta, destination) of keys whose target was asked here but whose
destination was not host memory: the leased read gives it the same one without asking
again."""


def _host(out: Any) -> bool:
    """Whether `out` is host memory this module copies into (not a tensor)."""
    if isinstance(out, HostRanges):
        return True
    try:
        memoryview(out).release()
    except TypeError:
        return False
    return True


def locate(index: IndexReader, key: bytes) -> tuple[int, int, Where] | None:
    """The key's slot as a lease-free read starts from (`IndexReader.locate`): a module
    function so that a test can act between it and the copy."""
    return index.locate(key)


def read_window(index: IndexReader, arena: memoryview, base: int, metas: Metas,
                keys: Sequence[bytes], start: int, target: ReadTarget,
                sizes: list[int]) -> tuple[list[int], Remembered, list[bytes]]:
    """Read what the table allows of a window without a lease, into what `target` gives
    (sizes from `start` on, as `transport.read_window`). Returns the window indices left
    for the socket, the destinations already asked for among them, and the keys read."""
    epoch = index.epoch()
    if epoch is None:
        return list(range(len(keys))), {}, []
    left: list[int] = []
    remembered: Remembered = {}
    copies = BufferCopies(arena, verify=True, base=base)  # always checked: the checksum is
    started: list[tuple[int, int, int, int]] = []          # half of the validation
    checks: list[Check] = []
    limit = arena.nbytes
    try:
        for i, key in enumerate(keys):
            got = locate(index, key) if len(key) == KEY_BYTES else None
            meta = None if got is None else metas.get(got[2][4])
            if got is None or meta is None:
                left.append(i)
                continue
            at, seq, (offset, size, checksum, kind, _) = got
            if offset + size > limit:
                left.append(i)  # (never: the agent's table names its own arena)
                continue
            out = target(start + i, size, meta)
            if out is None:
                continue  # declined, as a leased read's target may (a size of 0)
            if not _host(out):
                remembered[i] = (size, meta, out)
                left.append(i)
                continue
            lease = p.AcquireReply(0, 0, size, checksum, [(offset, size)], meta, 2, kind)
            started.append((i, at, seq, size))
            checks.append(copies.read(start + i, lease, out))
        copies.fence()
    except BaseException:
        copies.settle()
        raise
    read: list[bytes] = []
    for (i, at, seq, size), check in zip(started, checks, strict=True):
        # The checksum first (the copy's own bytes), then the slot: read after every
        # copied byte, it says whether the chunk's pages could have changed hands.
        if check() and index.unchanged(at, seq, keys[i], epoch):
            sizes[start + i] = size
            read.append(keys[i])
        else:
            left.append(i)
    left.sort()
    return left, remembered, read


def located(index: IndexReader, keys: Sequence[bytes]) -> None:
    """Called by `read_planned`'s compiled call between its table reads and its copies
    where a test replaces it (the default does nothing and is not called): a module
    function so that a test can act there (as `locate` for `read_window`)."""


_LOCATED = located
_SKIP = leasekernel.PARAMS.index("skip")
_HOOK = ctypes.CFUNCTYPE(None)
_last_message: tuple[int, bytes, bytes, int] = (-1, b"", b"", 0)


def _message(size: int, meta: bytes) -> tuple[bytes, int]:
    """`wsum_message(size, meta)` for the compiled call (empty where it is over the compiled
    hash's MAX_MESSAGE bytes), the last one kept."""
    global _last_message
    last = _last_message
    if last[0] == size and last[1] is meta:
        return last[2], last[3]
    message, sums_at = wsum_message(size, meta)
    if len(message) > leasekernel.MAX_MESSAGE:
        message = b""
    _last_message = (size, meta, message, sums_at)
    return message, sums_at


def _plan(kernels: leasekernel.Kernels, index: IndexReader, base: int, limit: int,
          size: int, meta: bytes, meta_hash: int, blocks: HostBlocks | None
          ) -> leasekernel.Plan:
    message, sums_at = _message(size, meta)
    plan = leasekernel.Plan(kernels, index.address, index.mask, base, limit, size,
                            meta_hash, message, sums_at, blocks)
    plan.source = index
    return plan


def _read(plan: leasekernel.Plan, index: IndexReader, keys: Sequence[bytes],
          read: Callable[[], int]) -> int:
    """`read()`, with the test's `located` called between the table reads and the copies."""
    hook = _HOOK(lambda: located(index, keys))
    plan.set_hook(ctypes.cast(hook, ctypes.c_void_p).value or 0)
    try:
        return read()
    finally:
        plan.set_hook(0)


def read_planned(index: IndexReader, base: int, limit: int, keys: Sequence[bytes],
                 start: int, target: HostTargets | BlockTargets, sizes: list[int]
                 ) -> tuple[list[int], list[bytes]] | None:
    """`read_window` for a window whose destinations are known (`HostTargets`, or
    `BlockTargets`, whose ranges the call makes from block ids) in one compiled call
    (`leasekernel.read`): the table's epoch, the slots read under their seqlock, the copies
    with their sums and each chunk's checksum from them (here, from the sums, where its WSUM
    head and metadata are over the compiled hash's 240 bytes), the slots and the epoch read
    again, with no Python per chunk. Returns the window indices left (for `read_window`,
    then the socket: any chunk not read here: not in the table as one WSUM extent of the
    target's size and metadata, ranges cut inside a word, a slot or epoch that changed, a
    checksum mismatch) and the keys read; None where the compiled call cannot take the
    window (not compiled yet: compiling now on a thread of its own; a malformed key;
    destinations not given for every key). A `BlockTargets` with a block id outside its
    blocks raises ValueError, nothing read."""
    kernels = leasekernel.ready()
    if kernels is None:
        leasekernel.compile_soon()
        return None
    n = len(keys)
    want = b"".join(keys)
    if len(want) != KEY_BYTES * n or (n and max(map(len, keys)) != KEY_BYTES):
        return None
    if isinstance(target, BlockTargets):
        blocks = target.blocks
        per = blocks.per
        if len(target.ids) < (start + n) * per:
            return None
        plan = blocks.plan
        if plan is None or plan.source is not index:  # (one a connection's mapping)
            plan = blocks.plan = _plan(kernels, index, base, limit, blocks.size, blocks.meta,
                                       blocks.meta_hash, blocks)
        if n > plan.capacity:
            plan.grow(n)
        plan.words[_SKIP] = 0 if start else target.skip
        ids = target.ids.buffer_info()[0] + 8 * per * start
        got = kernels.read(plan.address, want, n, ids) if located is _LOCATED else \
            _read(plan, index, keys, lambda: plan.read(want, n, ids))
        if got < 0:
            target.check()  # raises: the ids were checked in the call
            return None
        meta = blocks.meta
    else:
        if len(target.starts) < start + n + 1 or target.size & 3:
            return None
        plan = _plan(kernels, index, base, limit, target.size, target.meta,
                     target.meta_hash, None)
        ranges = target.ranges.buffer_info()[0]
        starts = target.starts.buffer_info()[0] + 8 * start
        got = plan.read_ranges(want, n, ranges, starts) if located is _LOCATED else \
            _read(plan, index, keys, lambda: plan.read_ranges(want, n, ranges, starts))
        meta = target.meta
    size = plan.size
    if got == n and plan.checked:
        sizes[start : start + n] = [size] * n  # every chunk read (the usual load)
        return [], list(keys)
    words = leasekernel.INFO_WORDS * n
    info = plan.info
    passed: list[int] = info[: words : leasekernel.INFO_WORDS].tolist()  # 0: not read
    if not plan.checked and got > 0:
        wanted = info[3 : words : leasekernel.INFO_WORDS]
        digests = wsum_finish_many(size, plan.sums[: 2 * n].tobytes(), meta)
        passed = [int(a != 0 and digests[i] == wanted[i]) for i, a in enumerate(passed)]
    left: list[int] = []
    read: list[bytes] = []
    for i, ok in enumerate(passed):
        if ok:
            sizes[start + i] = size
            read.append(keys[i])
        else:
            left.append(i)
    return left, read


def socket_target(target: ReadTarget, start: int, left: Sequence[int],
                  remembered: Remembered, metas: Metas) -> ReadTarget:
    """The target of the leased read of the keys `left` (window indices, numbered from 0
    in that read): the caller's, at the key's own index, learning each chunk's metadata;
    a destination asked for already is given again while the chunk is the same."""
    def leased(j: int, size: int, meta: bytes) -> Any:
        i = left[j]
        metas.learn(meta)
        got = remembered.get(i)
        if got is not None and got[0] == size and got[1] == meta:
            return got[2]
        return target(start + i, size, meta)
    return leased


def learning(target: ReadTarget, metas: Metas) -> Callable[[int, int, bytes], Any]:
    """`target`, learning the metadata of each chunk the agent describes."""
    def learn(i: int, size: int, meta: bytes) -> Any:
        metas.learn(meta)
        return target(i, size, meta)
    return learn
