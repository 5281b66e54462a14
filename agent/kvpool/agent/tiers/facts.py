"""The policy facts of a tier's chunks (`policy.Entry`), in flat rows by slot.

DRAM's rows and NVMe's index keep them alike: how often a chunk was hit, the request
(LOOKUP seq) and depth in its prefix that last touched it, and when. Views of a chunk
(`DramChunk`, `NvmeChunk`) read and write them through `SlotFacts`; LOOKUP's hot path
updates them by slot without making a view (`FactRows.hit`).
"""

from __future__ import annotations

from array import array
from typing import Protocol

from .. import probekernel


class FactRows:
    """One row of facts per slot, in parallel arrays indexed by it."""

    __slots__ = ("access", "depth", "hits", "seq")

    def __init__(self) -> None:
        self.hits = array("q")
        self.seq = array("q")
        self.depth = array("i")
        self.access = array("d")

    def add_row(self) -> None:
        for column in (self.hits, self.seq, self.depth):
            column.append(0)
        self.access.append(0.0)

    def set(self, slot: int, hits: int, seq: int, depth: int, now: float) -> None:
        self.hits[slot], self.seq[slot], self.depth[slot] = hits, seq, depth
        self.access[slot] = now

    def hit(self, slot: int, seq: int, depth: int, now: float) -> None:
        """The chunk in `slot` was hit by request `seq` at `depth` of its prefix, at
        wall-clock time `now`."""
        self.hits[slot] += 1
        self.seq[slot], self.depth[slot], self.access[slot] = seq, depth, now


def hit_run(rows: FactRows, slots: array[int], n: int, seq: int, now: float,
            compiled: bool = True) -> None:
    """`FactRows.hit` of the first `n` of `slots`, each at its index as its depth (a
    LOOKUP's leading DRAM keys), in one compiled call where there is one
    (`probekernel`)."""
    kernels = probekernel.ready() if compiled else None
    if kernels is None:
        for depth in range(n):
            rows.hit(slots[depth], seq, depth, now)
        return
    if n > len(slots):
        raise ValueError(f"{n} hits of {len(slots)} slots")
    kernels.facts(slots.buffer_info()[0], n, len(rows.seq), rows.hits.buffer_info()[0],
                  rows.seq.buffer_info()[0], rows.depth.buffer_info()[0],
                  rows.access.buffer_info()[0], seq, now)


class HasFacts(Protocol):
    facts: FactRows


class SlotFacts:
    """A view's facts, in its owner's `FactRows` at its slot (the view holds its owner as
    `_t` and its `slot`)."""

    __slots__ = ()
    _t: HasFacts
    slot: int

    @property
    def hits(self) -> int:
        return self._t.facts.hits[self.slot]

    @hits.setter
    def hits(self, n: int) -> None:
        self._t.facts.hits[self.slot] = n

    @property
    def last_seq(self) -> int:
        return self._t.facts.seq[self.slot]

    @last_seq.setter
    def last_seq(self, seq: int) -> None:
        self._t.facts.seq[self.slot] = seq

    @property
    def depth(self) -> int:
        return self._t.facts.depth[self.slot]

    @depth.setter
    def depth(self, depth: int) -> None:
        self._t.facts.depth[self.slot] = depth

    @property
    def last_access(self) -> float:
        return self._t.facts.access[self.slot]

    @last_access.setter
    def last_access(self, t: float) -> None:
        self._t.facts.access[self.slot] = t
