"""What every tier below DRAM implements, and the chunk format they store.

G3 (NVMe files) and G4 (shared file system or S3 objects) hold chunks as
self-describing blobs: a fixed header (magic, format version, flags = the
checksum kind, key, size, fingerprint id, checksum, metadata and tenant
lengths), then the metadata,
the tenant name and the chunk bytes. Readers verify the checksum before
returning anything: a mismatch is a miss (and a counted integrity failure),
never data.

The store calls these methods from worker threads (they block on I/O), so a
slow disk or store never stalls the event loop.
"""

from __future__ import annotations

import io
import os
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from .. import checksums
from ..chunkblocks import COPY_BLOCK
from ..config import TierName

MAGIC = b"KVPC"
FORMAT_VERSION = 1
# magic, version, flags, key, size, fingerprint id, checksum, meta len, tenant len, reserved;
# flags holds the checksum kind (0, XXH3, in every blob written before kinds existed)
_HEADER = struct.Struct("<4sHH16sQQQIHH")
HEADER_BYTES = _HEADER.size
MAX_TENANT_NAME_BYTES = 0xFFFF
"""The header's tenant length field is 16 bits."""


class IntegrityError(Exception):
    """Stored bytes do not match their checksum (or the header is damaged)."""


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """A chunk as it moves between tiers."""

    key: bytes
    data: bytes | memoryview
    checksum: int
    meta: bytes = b""
    tenant: str = ""
    fingerprint_id: int = 0
    checksum_kind: int = checksums.XXH3

    @property
    def size(self) -> int:
        return len(self.data)

    def verify(self) -> bool:
        if self.checksum_kind not in checksums.KINDS:
            return False
        return checksums.compute(self.checksum_kind, [self.data], self.meta) == self.checksum


def encode_header(rec: ChunkRecord) -> bytes:
    tenant = rec.tenant.encode()
    if len(tenant) > MAX_TENANT_NAME_BYTES:  # HELLO caps names far below; never a struct.error
        raise ValueError(f"tenant name of {len(tenant)} bytes does not fit a chunk header")
    return _HEADER.pack(MAGIC, FORMAT_VERSION, rec.checksum_kind, rec.key, rec.size,
                        rec.fingerprint_id,
                        rec.checksum, len(rec.meta), len(tenant), 0) + rec.meta + tenant


def encode(rec: ChunkRecord) -> list[bytes | memoryview]:
    """The blob as buffers to write in order (no copy of the chunk bytes)."""
    return [encode_header(rec), rec.data]


@dataclass(frozen=True, slots=True)
class Header:
    key: bytes
    size: int
    fingerprint_id: int
    checksum: int
    meta: bytes
    tenant: str
    data_offset: int
    checksum_kind: int = checksums.XXH3


def header_length(prefix: bytes | memoryview) -> int:
    """The whole header's length (fixed part, metadata, tenant name) from its fixed part:
    how much a reader that wants only the header must read."""
    if len(prefix) < HEADER_BYTES:
        raise IntegrityError(f"truncated header ({len(prefix)} bytes)")
    *_, meta_len, tenant_len, _ = _HEADER.unpack_from(prefix)
    return int(HEADER_BYTES + meta_len + tenant_len)


def decode_header(blob: bytes | memoryview) -> Header:
    """Parse the header at the start of `blob` (which must hold at least the header)."""
    if len(blob) < HEADER_BYTES:
        raise IntegrityError(f"truncated header ({len(blob)} bytes)")
    magic, version, kind, key, size, fp, checksum, meta_len, tenant_len, _ = \
        _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise IntegrityError("not a kvpool chunk (bad magic)")
    if version != FORMAT_VERSION:
        raise IntegrityError(f"chunk format version {version} is not {FORMAT_VERSION}")
    end = HEADER_BYTES + meta_len + tenant_len
    if len(blob) < end:
        raise IntegrityError("truncated header")
    meta = bytes(blob[HEADER_BYTES : HEADER_BYTES + meta_len])
    tenant = bytes(blob[HEADER_BYTES + meta_len : end]).decode(errors="replace")
    return Header(bytes(key), size, fp, checksum, meta, tenant, end, kind)


def decode(blob: bytes | memoryview, expect_key: bytes | None = None) -> ChunkRecord:
    """A verified record from a whole blob; raises IntegrityError on any mismatch."""
    h = decode_header(blob)
    if expect_key is not None and h.key != expect_key:
        raise IntegrityError(f"blob holds key {h.key.hex()}, expected {expect_key.hex()}")
    data = memoryview(blob)[h.data_offset :]
    if len(data) != h.size:
        raise IntegrityError(f"chunk is {len(data)} bytes, header says {h.size}")
    rec = ChunkRecord(h.key, data, h.checksum, h.meta, h.tenant, h.fingerprint_id,
                      h.checksum_kind)
    if not rec.verify():
        raise IntegrityError(f"checksum mismatch for {h.key.hex()}")
    return rec


def read_chunk_file(f: io.FileIO, expect_key: bytes | None = None,
                  block: int = COPY_BLOCK) -> ChunkRecord:
    """A verified record read from a chunk file open at its start, in one pass; raises
    IntegrityError on any mismatch, as `decode` does for a whole blob.

    The chunk bytes go into one buffer sized from the header, `block` bytes at a time (a
    copy block, `chunkblocks.COPY_BLOCK`, unless told), and an XXH3 chunk hashes each
    block right after reading it, while it is still in the CPU cache: reading the whole
    file and then hashing it read the chunk from memory twice (the streaming digest of
    meta then data equals `checksums.xxh3`); a WSUM chunk is summed block by block the
    same way (`checksums.Wsum`). (numpy is imported here, not at start: only an agent
    with an NVMe tier needs it.)
    """
    head = f.read(HEADER_BYTES)
    head += f.read(max(0, header_length(head) - len(head)))
    h = decode_header(head)
    if expect_key is not None and h.key != expect_key:
        raise IntegrityError(f"blob holds key {h.key.hex()}, expected {expect_key.hex()}")
    # Checked against the file's size before allocating: a damaged size field must be
    # a mismatch, not a buffer of whatever size it claims.
    size = os.fstat(f.fileno()).st_size - h.data_offset
    if size != h.size:
        raise IntegrityError(f"chunk is {size} bytes, header says {h.size}")
    # numpy's empty buffer, not bytearray(size): that zero-fills the whole chunk first, a
    # pass over memory that cost more than the one the streaming hash saves.
    import numpy as np

    view = np.empty(h.size, dtype=np.uint8).data
    hasher = xxhash.xxh3_64(h.meta) if h.checksum_kind == checksums.XXH3 else None
    wsum = checksums.Wsum() if h.checksum_kind == checksums.WSUM else None
    pos = 0
    while pos < h.size:
        got = f.readinto(view[pos : pos + min(block, h.size - pos)])
        if not got:  # the file shrank since fstat
            raise IntegrityError(f"chunk is {pos} bytes, header says {h.size}")
        if hasher is not None:
            hasher.update(view[pos : pos + got])
        elif wsum is not None:
            wsum.update(view[pos : pos + got])
        pos += got
    rec = ChunkRecord(h.key, view, h.checksum, h.meta, h.tenant, h.fingerprint_id,
                      h.checksum_kind)
    if hasher is not None:
        ok = hasher.intdigest() == h.checksum
    elif wsum is not None:
        ok = wsum.intdigest(h.meta) == h.checksum
    else:
        ok = rec.verify()  # an unknown kind: verify() says so
    if not ok:
        raise IntegrityError(f"checksum mismatch for {h.key.hex()}")
    return rec


class ChunkTier(ABC):
    """A tier below DRAM. Methods block; call them from a worker thread."""

    name: TierName

    @property
    @abstractmethod
    def capacity_bytes(self) -> int:
        """Configured capacity (0: unbounded, e.g. an object store)."""

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def chunks(self) -> int: ...

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether the tier holds the key (may do I/O for remote tiers)."""

    @abstractmethod
    def read(self, key: bytes) -> ChunkRecord | None:
        """The verified chunk, or None if absent. Raises IntegrityError on a bad chunk
        (after quarantining or deleting it) and OSError when the tier fails."""

    @abstractmethod
    def write(self, rec: ChunkRecord) -> None:
        """Store atomically: readers see the whole chunk or nothing. Raises OSError."""

    @abstractmethod
    def delete(self, key: bytes) -> bool: ...

    @abstractmethod
    def keys(self) -> Iterable[bytes]: ...

    def healthy(self) -> tuple[bool, str]:
        """(serving?, reason when not)."""
        return True, ""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
