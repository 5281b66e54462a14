"""Checksum kinds: how a chunk's 64-bit checksum is defined, recorded with the chunk.

Every chunk carries a checksum from its first COMMIT, and the agent verifies it on
every move between tiers and every read from G3/G4, whatever its kind:

- `XXH3` (kind 0, the default): XXH3-64 over the metadata then the chunk bytes.
  A client computes it on the CPU over the bytes it wrote into the arena.
- `WSUM` (kind 1, "kvpool-wsum-v1"): the sum and the position-weighted sum of the
  chunk's 32-bit words, finished by XXH3-64 with the size and the metadata. It is
  made of elementwise integer operations and two reductions, so a client can compute
  it on the GPU from the source tensor (`kvpool.agent.gpu`) instead of hashing the
  arena bytes on the CPU after the DMA; the agent computes the same function on the
  CPU wherever it verifies a chunk, as fast as XXH3 (`kvpool.agent.wsumkernel`).

WSUM, exactly: pad the chunk's `size` bytes with zeros to a multiple of 4 and read
them as little-endian unsigned 32-bit words u_0 .. u_{n-1}. With

    S0 = sum(u_i) mod 2^64,    S1 = sum(i * u_i) mod 2^64

the checksum is XXH3-64 of `b"kvpool-wsum-v1\\0" + le64(size) + le64(S0) + le64(S1) + meta`.

What it detects, for chunks below 4 GiB (n < 2^30; chunks are far smaller):
- always: any damage confined to at most two 32-bit words. One damaged word changes
  S0 (its change is below 2^32 and S0 never wraps). Two damaged words i < j that
  leave S0 equal have changes e and -e, so S1 changes by (j - i) * e, which is
  nonzero and below 2^62 in size. That covers every flipped bit, every damaged byte,
  any damaged run of up to 5 bytes, and any two words swapped.
- always: a different size or different metadata (they are hashed as they are).
- otherwise, damage spread over three or more words goes undetected only when both
  sums happen to match: for random damage about as likely as an XXH3-64 collision,
  but some structured patterns cancel (e.g. changes +e, -2e, +e on three consecutive
  words), which XXH3 would catch. Two equal-length runs swapped go undetected only
  when their word sums are equal modulo 2^64 / (distance between them).
It is not a cryptographic hash: like XXH3 it protects against accidents (a bad copy,
a torn write, a flipped bit in memory, on disk or in the object store), not against
a client that forges a matching checksum for bytes it wrote itself.

The CPU computation (`Wsum`) needs numpy, and llvmlite for its speed (both imported only
when a WSUM chunk is summed on the CPU; without llvmlite, numpy alone, several times slower).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import xxhash

from . import wsumkernel

XXH3 = 0
WSUM = 1
KINDS = {XXH3: "xxh3", WSUM: "wsum"}
"""Every kind the agent verifies, by the code COMMIT carries."""

WSUM_DOMAIN = b"kvpool-wsum-v1\x00"
U64 = (1 << 64) - 1
_BLOCK_WORDS = 1 << 18
"""Words numpy takes at once: 1 MiB of chunk."""
_ramp: Any = None


def xxh3(parts: Iterable[Any], meta: bytes = b"") -> int:
    """XXH3-64 over `meta` then the buffers of `parts` in order."""
    h = xxhash.xxh3_64()
    h.update(meta)
    for part in parts:
        h.update(part)
    return int(h.intdigest())


def wsum_finish(size: int, s0: int, s1: int, meta: bytes = b"") -> int:
    """The WSUM checksum from the chunk's size and its two word sums."""
    head = WSUM_DOMAIN + struct.pack("<QQQ", size, s0 & U64, s1 & U64)
    return int(xxhash.xxh3_64_intdigest(head + meta))


def wsum_message(size: int, meta: bytes = b"") -> tuple[bytes, int]:
    """What `wsum_finish` hashes for a chunk of `size` bytes and metadata `meta`, with
    zeros for its sums, and where the sums go (S0, S1: u64 little-endian, one after the
    other): for a compiled loop that writes each chunk's sums in and hashes it."""
    return WSUM_DOMAIN + struct.pack("<QQQ", size, 0, 0) + meta, len(WSUM_DOMAIN) + 8


def wsum_finish_many(size: int, sums: bytes, meta: bytes = b"") -> list[int]:
    """`wsum_finish` of chunks of one `size` and metadata, from their (S0, S1) as u64
    little-endian pairs one after the other (`sums`, 16 bytes a chunk, e.g. a compiled
    loop's output): the same bytes hashed, with no Python step a word."""
    head = WSUM_DOMAIN + struct.pack("<Q", size)
    return [xxhash.xxh3_64_intdigest(head + sums[k : k + 16] + meta)
            for k in range(0, len(sums), 16)]


class Wsum:
    """WSUM's sums over a chunk fed in parts (`update`, any cut, like `xxhash.xxh3_64`).

    Whole 128-byte rows go through the compiled loop of `kvpool.agent.wsumkernel` (as
    fast as XXH3); what it cannot take (the few words after the last row, a word split
    between two parts) and everything where it is not available (`kernel=False`, or no
    llvmlite: the client's light install) is summed with numpy."""

    def __init__(self, kernel: bool = True) -> None:
        self.size = 0
        self.s0 = self.s1 = 0
        self._words = 0
        self._carry = b""
        self._kernel = kernel

    def update(self, part: Any) -> None:
        raw = memoryview(part).cast("B")
        self.size += raw.nbytes
        if self._carry:  # the previous part ended inside a word: finish it with these bytes
            take = min(4 - len(self._carry), raw.nbytes)
            self._carry += bytes(raw[:take])
            raw = raw[take:]
            if len(self._carry) < 4:
                return
            self._add(self._carry)
            self._carry = b""
        whole = raw.nbytes - raw.nbytes % 4
        if whole:
            self._add(raw[:whole])
        self._carry = bytes(raw[whole:])

    def sums(self) -> tuple[int, int, int]:
        """(size, S0, S1) of the bytes so far, the last word padded with zeros."""
        s0, s1 = self.s0, self.s1
        if self._carry:
            last = int.from_bytes(self._carry.ljust(4, b"\0"), "little")
            s0 += last
            s1 += self._words * last
        return self.size, s0 & U64, s1 & U64

    def intdigest(self, meta: bytes = b"") -> int:
        """The WSUM checksum of the bytes so far with `meta`."""
        return wsum_finish(*self.sums(), meta)

    def _add(self, whole_words: Any) -> None:
        import numpy as np

        data = np.frombuffer(whole_words, dtype=np.uint8)
        rows = data.nbytes // wsumkernel.ROW_BYTES if self._kernel else 0
        done = wsumkernel.row_sums(data.ctypes.data, rows) if rows else None
        if done is None:
            rows, done = 0, (0, 0)
        s0, s1 = done
        head = rows * wsumkernel.ROW_BYTES
        if head < data.nbytes:  # the words after the last whole row (or all of them)
            rest0, rest1 = _numpy_word_sums(data[head:].view("<u4"))
            s0 += rest0
            s1 += rest1 + head // 4 * rest0  # the rest's words come after the rows'
        self.s1 = (self.s1 + s1 + self._words * s0) & U64
        self.s0 = (self.s0 + s0) & U64
        self._words += data.nbytes // 4


def _numpy_word_sums(words: Any) -> tuple[int, int]:
    """(S0, S1) modulo 2^64 of a uint32 array, word indices from 0, with numpy."""
    import numpy as np

    global _ramp
    if _ramp is None:
        _ramp = np.arange(_BLOCK_WORDS, dtype=np.uint64)
    s0 = s1 = 0
    for start in range(0, len(words), _BLOCK_WORDS):
        u = words[start : start + _BLOCK_WORDS].astype(np.uint64)
        total = int(u.sum(dtype=np.uint64))
        s0 += total
        # uint64 arithmetic wraps modulo 2^64, as the definition does
        s1 += int(np.dot(u, _ramp[: len(u)])) + start * total
    return s0 & U64, s1 & U64


def wsum_sums(parts: Iterable[Any], kernel: bool = True) -> tuple[int, int, int]:
    """(size, S0, S1) of the chunk made of `parts` (buffers, in order), on the CPU."""
    h = Wsum(kernel)
    for part in parts:
        h.update(part)
    return h.sums()


def compute(kind: int, parts: Iterable[Any], meta: bytes = b"") -> int:
    """The checksum of kind `kind` of the chunk made of `parts`, with its metadata."""
    if kind == XXH3:
        return xxh3(parts, meta)
    if kind == WSUM:
        return wsum_finish(*wsum_sums(parts), meta)
    raise ValueError(f"unknown checksum kind {kind}; known: {sorted(KINDS)}")


def check_kind(kind: int) -> None:
    """Raise ValueError for a kind the agent cannot verify."""
    if kind not in KINDS:
        raise ValueError(f"unknown checksum kind {kind}; known: {sorted(KINDS)}")
