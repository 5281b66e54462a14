"""The store's memory of its DELETEs: whether a key was deleted since a given moment.

A DELETE is final. Work that began before it and makes a chunk visible again when it
ends (a read below DRAM, a promotion waiting for room, a peer read, an NVMe file passed
on to G4) takes a `mark()` when it begins and asks `since(key, mark)` before it does.
"""

from __future__ import annotations

from collections import OrderedDict

RECENT_DELETES = 1 << 16
"""Deletes remembered; work outlived by more deletes than this takes its key as deleted."""


class Deletes:
    def __init__(self, remembered: int = RECENT_DELETES) -> None:
        self.count = 0
        """DELETEs so far."""
        self._recent: OrderedDict[bytes, int] = OrderedDict()
        """Recently deleted keys, with the `count` of their last delete."""
        self._remembered = remembered

    def mark(self) -> int:
        """Now, for a later `since`."""
        return self.count

    def record(self, key: bytes) -> None:
        """`key` was deleted, now."""
        self.count += 1
        self._recent[key] = self.count
        self._recent.move_to_end(key)
        while len(self._recent) > self._remembered:
            self._recent.popitem(last=False)

    def since(self, key: bytes, mark: int) -> bool:
        """Whether `key` was deleted after `mark`."""
        n = self._recent.get(key)
        if n is not None:
            return n > mark
        # Not remembered: deleted since only if deletes were forgotten since the mark.
        oldest = next(iter(self._recent.values()), mark + 1)
        return len(self._recent) >= self._remembered and oldest > mark
