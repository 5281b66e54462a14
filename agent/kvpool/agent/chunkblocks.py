"""A chunk's bytes in blocks: the unit a copy into or out of the arena hashes while it is
still in the CPU's cache (`transport.copy_and_checksum`, `transport.copy_out`, the copy
threads' jobs in `copythreads`, a peer's chunk received in `peers.links`, a chunk file
read in `tiers.base.read_chunk_file`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

COPY_BLOCK = 1 << 20
"""Bytes a put copies into the arena before hashing them: small enough that the block
is still in L2 when the checksum reads it back, large enough that the per-block
Python overhead (~1 µs) is noise. 0.5-2 MiB measured alike here; 4 MiB was slower."""


def blocks(extents: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
    """(arena offset, offset in the chunk, length) of each block of at most COPY_BLOCK
    bytes of a chunk laid out in `extents`, in chunk order."""
    pos = 0
    for offset, nbytes in extents:
        for skip in range(0, nbytes, COPY_BLOCK):
            yield offset + skip, pos + skip, min(COPY_BLOCK, nbytes - skip)
        pos += nbytes
