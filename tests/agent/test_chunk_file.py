"""Reading a chunk file in one pass (`base.read_chunk_file`, the G3 read path): the
streaming verification agrees with the whole-blob one and refuses what it refuses."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from kvpool.agent import checksums
from kvpool.agent.tiers import base

KEY = bytes(range(16))
BLOCK = 4096


def chunk_file(tmp_path: Path, kind: int, size: int = 5 * BLOCK + 123) -> tuple[Path, bytes]:
    data = os.urandom(size)
    rec = base.ChunkRecord(KEY, data, checksums.compute(kind, [data], b"meta"), b"meta",
                           "tenant", 7, kind)
    path = tmp_path / "chunk"
    path.write_bytes(b"".join(bytes(b) for b in base.encode(rec)))
    return path, data


def read(path: Path, expect_key: bytes | None = KEY) -> base.ChunkRecord:
    with open(path, "rb", buffering=0) as f:
        return base.read_chunk_file(f, expect_key=expect_key, block=BLOCK)


@pytest.mark.parametrize("kind", sorted(checksums.KINDS))
def test_a_chunk_read_block_by_block_is_the_chunk_written(tmp_path: Path, kind: int) -> None:
    path, data = chunk_file(tmp_path, kind)
    rec = read(path)
    assert bytes(rec.data) == data
    assert (rec.meta, rec.tenant, rec.fingerprint_id, rec.checksum_kind) == \
        (b"meta", "tenant", 7, kind)


@pytest.mark.parametrize("kind", sorted(checksums.KINDS))
def test_a_byte_damaged_past_the_first_block_is_a_checksum_mismatch(
        tmp_path: Path, kind: int) -> None:
    path, _ = chunk_file(tmp_path, kind)
    damaged = bytearray(path.read_bytes())
    damaged[-3 * BLOCK] ^= 0x10
    path.write_bytes(bytes(damaged))
    with pytest.raises(base.IntegrityError, match="checksum mismatch"):
        read(path)


def test_a_size_field_larger_than_the_file_is_refused_before_any_buffer(tmp_path: Path) -> None:
    path, _ = chunk_file(tmp_path, checksums.XXH3)
    blob = bytearray(path.read_bytes())
    struct.pack_into("<Q", blob, 24, 1 << 50)  # the size field: no buffer of a PiB
    path.write_bytes(bytes(blob))
    with pytest.raises(base.IntegrityError, match="header says"):
        read(path)


def test_a_truncated_file_and_another_key_are_refused(tmp_path: Path) -> None:
    path, _ = chunk_file(tmp_path, checksums.XXH3)
    with pytest.raises(base.IntegrityError, match="expected"):
        read(path, expect_key=bytes(16))
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(base.IntegrityError, match="header says"):
        read(path)
    path.write_bytes(path.read_bytes()[:10])
    with pytest.raises(base.IntegrityError, match="truncated header"):
        read(path)
