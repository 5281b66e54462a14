"""NVMe read-ahead: chunks read with an earlier chunk of their prompt, waiting for their own read.

A client reads a prompt's chunks one after the other; one worker-thread read of all
of its NVMe chunks costs one thread hand-off instead of one per chunk. `ReadAhead`
remembers which keys recent LOOKUPs found in NVMe (to know what follows a key) and
keeps the extra chunks such a read took, verified, until their own read takes them.
A kept chunk is good only while the NVMe index still holds the entry it was read
under (an equal `NvmeChunk`): never after a delete, a rewrite or an eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from ..tiers.base import ChunkRecord
from ..tiers.nvmeindex import NvmeChunk

READAHEAD_CHUNKS = 32
"""Most chunks one NVMe read of a client takes: the one asked for and those after it."""
READAHEAD_BYTES = 32 << 20
"""Most bytes one such read takes, and (twice that) read-ahead chunks kept waiting."""
RECENT_PROMPTS = 256
"""Recent LOOKUPs that reached NVMe whose keys are kept, to know what follows a key."""


class ReadAhead:
    def __init__(self) -> None:
        self._prompts: OrderedDict[int, list[bytes]] = OrderedDict()
        """Keys of recent LOOKUPs that found chunks in NVMe, by request seq."""
        self._kept: OrderedDict[bytes, tuple[ChunkRecord, NvmeChunk]] = OrderedDict()
        self.bytes = 0
        """Chunk bytes kept waiting."""

    def __contains__(self, key: bytes) -> bool:
        return key in self._kept

    def __iter__(self) -> Iterator[bytes]:
        """Keys kept waiting, oldest first."""
        return iter(self._kept)

    def remember_prompt(self, seq: int, keys: list[bytes]) -> None:
        """A LOOKUP (request `seq`) found these leading keys locally, some in NVMe."""
        self._prompts[seq] = keys
        if len(self._prompts) > RECENT_PROMPTS:
            self._prompts.popitem(last=False)

    def following(self, key: bytes, seq: int, depth: int,
                  entry: Callable[[bytes], NvmeChunk | None],
                  busy: Callable[[bytes], bool]) -> list[bytes]:
        """The keys after `key` (at `depth` of LOOKUP `seq`) that NVMe holds (its `entry`)
        and that are not `busy` (being read, kept, on their way down, in DRAM), within the
        read's caps."""
        prompt = self._prompts.get(seq)
        if prompt is None or depth >= len(prompt) or prompt[depth] != key:
            return []
        first = entry(key)
        if first is None:
            return []
        out: list[bytes] = []
        total = first.size
        for k in prompt[depth + 1 :]:
            if len(out) + 1 >= READAHEAD_CHUNKS:
                break
            chunk = entry(k)
            if chunk is None or k in self._kept or busy(k):
                continue
            total += chunk.size
            if total > READAHEAD_BYTES:
                break
            out.append(k)
        return out

    def keep(self, key: bytes, rec: ChunkRecord, entry: NvmeChunk) -> None:
        self.drop(key)
        self._kept[key] = (rec, entry)
        self.bytes += rec.size
        while self.bytes > 2 * READAHEAD_BYTES:
            _, (old, _) = self._kept.popitem(last=False)
            self.bytes -= old.size

    def drop(self, key: bytes) -> None:
        kept = self._kept.pop(key, None)
        if kept is not None:
            self.bytes -= kept[0].size

    def take(self, key: bytes, entry: Callable[[bytes], NvmeChunk | None]
             ) -> tuple[ChunkRecord, NvmeChunk] | None:
        """The kept chunk of `key`, when NVMe's index still holds (`entry`) the entry it
        was read under."""
        kept = self._kept.pop(key, None)
        if kept is None:
            return None
        rec, read_under = kept
        self.bytes -= rec.size
        if entry(key) != read_under:
            return None  # deleted, rewritten or evicted since: read again (or miss)
        return rec, read_under
