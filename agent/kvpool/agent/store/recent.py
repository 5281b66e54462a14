"""The keys of recent LOOKUPs: where each stood in the last one that asked for it.

A chunk written or read after a LOOKUP keeps the request grouping that LOOKUP gave it (its
request's seq and its depth in the prefix: what the eviction orders and the read batches
go by). Remembering that costs every LOOKUP one step per key, so the step is one C loop:
a key maps to its LOOKUP's seq alone (`dict.update` of the keys with one value), each
LOOKUP's key list is kept once, and a key's depth is found from that list when asked (a
read or a write asks for one key; a LOOKUP tells 128): the first read of a LOOKUP's keys
makes a key -> depth dict of that list (one C loop), which its later reads use, so the
reads of a LOOKUP of n keys cost O(n) together, not O(n) each.

Bounded by generations: keys go into the current one; once the next LOOKUP's keys would
take it past `keys // 2` it becomes the previous one and the one before is dropped with
its LOOKUPs. So the last `keys // 2` keys told, less one LOOKUP's, are always remembered
(as the store's OrderedDict of the last `keys` did), and at most `keys` are.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count, repeat


class RecentLookups:
    def __init__(self, keys: int) -> None:
        self._half = max(1, keys // 2)
        self._seq: dict[bytes, int] = {}
        """Key -> the seq of the last LOOKUP that asked for it (the current generation)."""
        self._old: dict[bytes, int] = {}
        """The previous generation's."""
        self._keys: dict[int, _Prompt] = {}
        """Each LOOKUP's keys, by seq (this generation's LOOKUPs): the keys as told, or
        once a read asked, each key's depth in them and the last depth."""
        self._old_keys: dict[int, _Prompt] = {}

    def __len__(self) -> int:
        """Keys remembered (a key in both generations counts once)."""
        return len(self._seq) + sum(1 for k in self._old if k not in self._seq)

    def told(self, seq: int, keys: Sequence[bytes]) -> None:
        """LOOKUP `seq` asked for `keys`, in order."""
        if len(self._seq) + len(keys) > self._half and self._seq:
            self._old, self._seq = self._seq, {}
            self._old_keys, self._keys = self._keys, {}
        self._seq.update(zip(keys, repeat(seq)))
        self._keys[seq] = tuple(keys)

    def get(self, key: bytes) -> tuple[int, int, bool] | None:
        """(seq, depth, last of its prompt) of the last LOOKUP that asked for `key`, or
        None."""
        seq = self._seq.get(key)
        keys = self._keys if seq is not None else self._old_keys
        if seq is None:
            seq = self._old.get(key)
            if seq is None:
                return None
        prompt = keys.get(seq)
        if prompt is None:
            return None
        if type(prompt) is tuple:
            # Each key's last place in that LOOKUP (a key asked twice in one is at its
            # deeper place: the later pair wins), made once for all of its reads.
            told = prompt
            prompt = keys[seq] = _Depths(zip(told, count()))
            prompt.last = len(told) - 1
        assert isinstance(prompt, _Depths)
        depth = prompt.get(key)
        if depth is None:  # (not in that LOOKUP: its seq is the key's, so it is)
            return None
        return seq, depth, depth == prompt.last


class _Depths(dict[bytes, int]):
    """A LOOKUP's keys -> each one's (last) depth in it, and the LOOKUP's last depth."""

    last = 0


_Prompt = tuple[bytes, ...] | _Depths
