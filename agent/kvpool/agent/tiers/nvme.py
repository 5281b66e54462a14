"""G3: one file per chunk under the pool's NVMe directory.

A chunk is written to a temporary name and renamed into place, so a crash
never leaves a half chunk under a real name; leftovers of interrupted writes
are removed at start. The in-memory index (key -> size and tenant, in flat
arrays: `nvmeindex.NvmeIndex`) is rebuilt at start from the files' headers
alone. Every read verifies the checksum: a bad file is moved to `quarantine/`
and reported as a miss.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from .. import atomicfile
from ..config import EvictionOrder
from ..constants import CHUNK_SUFFIX as SUFFIX
from ..eviction import EvictionQueue
from . import base
from .base import ChunkRecord, ChunkTier, IntegrityError
from .nvmeindex import NvmeChunk, NvmeIndex

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"
QUARANTINE_SHARE = 1 / 16
"""quarantine/ keeps bad files for inspection up to this share of the NVMe size (the
oldest go first); what it holds is taken from the size chunks may use."""


def file_bytes(rec: ChunkRecord) -> int:
    """Bytes a chunk's file takes (header and chunk): what NVMe reserves before writing it."""
    return len(base.encode_header(rec)) + rec.size


class NvmeTier(ChunkTier):
    name = "nvme"

    def __init__(self, root: Path, capacity: int) -> None:
        self.root = root
        self._capacity = capacity
        self.quarantine = root / "quarantine"
        self._used = 0
        self._lock = threading.Lock()
        """Serialises the index's writers and file renames and removals (worker threads
        and the event loop); readers of the index need none."""
        self.index = NvmeIndex(self._lock)
        self._unhealthy: str = ""
        self._subdirs: set[str] = set()
        """Fan-out directories known to exist (a mkdir per write costs a syscall)."""
        self._quarantined: OrderedDict[str, int] = OrderedDict()
        """Files in quarantine/ and their sizes, oldest first."""
        self._quarantined_bytes = 0
        self._qlock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True)
        self.quarantine.mkdir(exist_ok=True)
        self._scan_quarantine()
        self.rebuild()

    # -- layout

    def path_of(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / f"{h}{SUFFIX}"

    def rebuild(self) -> None:
        """Index every chunk file by its header; drop leftovers of interrupted writes."""
        index = NvmeIndex(self._lock)
        used = 0
        subdirs: set[str] = set()
        for sub in os.scandir(self.root):
            if not sub.is_dir() or sub.name == "quarantine":
                continue
            subdirs.add(sub.name)
            for entry in os.scandir(sub.path):
                if TMP_MARK in entry.name:
                    os.unlink(entry.path)
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    with open(entry.path, "rb") as f:
                        # The whole header, however long its metadata and tenant name:
                        # a fixed-size read quarantined valid chunks with large ones.
                        head = f.read(base.HEADER_BYTES)
                        head += f.read(max(0, base.header_length(head) - len(head)))
                    h = base.decode_header(head)
                    size = entry.stat().st_size
                    if size != h.data_offset + h.size or entry.name != h.key.hex() + SUFFIX:
                        raise IntegrityError("size or name does not match the header")
                except (OSError, IntegrityError) as e:
                    log.warning("quarantining %s at start: %s", entry.path, e)
                    self._quarantine(Path(entry.path))
                    continue
                used += size - index.put(h.key, size, h.tenant, entry.stat().st_mtime)
        with self._lock:
            self.index, self._used, self._subdirs = index, used, subdirs

    # -- ChunkTier

    @property
    def capacity_bytes(self) -> int:
        """The configured size less what quarantine/ holds: bad files take disk too."""
        return max(0, self._capacity - self._quarantined_bytes)

    @property
    def quarantined_bytes(self) -> int:
        return self._quarantined_bytes

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def chunks(self) -> int:
        return len(self.index)

    def contains(self, key: bytes) -> bool:
        return key in self.index

    def entry(self, key: bytes) -> NvmeChunk | None:
        """The indexed chunk of `key` (a view of its slot), or None."""
        return self.index.get(key)

    def entries(self) -> Iterator[NvmeChunk]:
        """The indexed chunks, in no particular order."""
        return self.index.values()

    def hit(self, key: bytes, seq: int, depth: int, now: float) -> int:
        """The slot of `key`, its chunk hit by request `seq` at `depth` at time `now`; -1:
        not indexed. On the event loop (LOOKUP's path: no view of the chunk is made)."""
        index = self.index
        slot = index.table.find(key)
        if slot >= 0:
            index.facts.hit(slot, seq, depth, now)
        return slot

    def new_queue(self, order: EvictionOrder, first: str) -> EvictionQueue:
        """An eviction queue in `order` holding every indexed chunk (`NvmeIndex.new_queue`)."""
        return self.index.new_queue(order, first)

    def reap(self, key: bytes) -> None:
        """Hand back the slot of a key taken out of the index (`NvmeIndex.reap`)."""
        self.index.reap(key)

    def read(self, key: bytes) -> ChunkRecord | None:
        entry = self.index.get(key)
        if entry is None:
            return None
        return self.read_file(key, entry)

    def read_file(self, key: bytes, entry: NvmeChunk | None = None) -> ChunkRecord | None:
        """The verified chunk in the key's file, indexed (`entry`: the index's entry it is
        read under) or not (eviction reads a chunk it has already taken out of the index,
        to pass it on to the shared tier)."""
        path = self.path_of(key)
        try:
            # Unbuffered: each block is read straight into the chunk's buffer.
            with open(path, "rb", buffering=0) as f:
                return base.read_chunk_file(f, expect_key=key)
        except FileNotFoundError:
            if entry is not None:
                self.forget(key, entry)
            return None
        except (OSError, IntegrityError):
            # An unreadable file (EIO, a directory in its place) or a bad one: out of the
            # index, or LOOKUP would keep answering nvme for a chunk no read returns, and
            # a fresh PUT of the key would be refused as a duplicate.
            if entry is not None:
                self.forget(key, entry)
            self._set_aside(key, path)
            raise

    def write(self, rec: ChunkRecord, wanted: Callable[[], bool] | None = None) -> None:
        """Write a chunk's file and index it. `wanted`, when given, is asked under the
        tier's lock right before the file is renamed into place and indexed: False
        withdraws the write (its temporary file goes, nothing is published). So whoever
        withdraws it inside `publishing()` knows the write has either been indexed
        already or never will be."""
        path = self.path_of(rec.key)
        header = base.encode_header(rec)
        total = len(header) + rec.size
        if path.parent.name not in self._subdirs:
            self._make_subdir(path.parent)
        tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}")

        def publish(tmp: Path, path: Path) -> None:
            with self._lock:  # serialised with remove_file: an old unlink never hits this file
                if wanted is not None and not wanted():
                    os.unlink(tmp)
                    return
                os.replace(tmp, path)
                # Stamped now, not 0: until the store files the entry in its eviction
                # order, a TTL sweep of the index must not take it for an ancient chunk.
                self._used += total - self.index.put(rec.key, total, rec.tenant, time.time())

        # Not synced: G3 is a cache. A power loss may leave a file torn under its real name;
        # every read checks the checksum, and a bad file is a miss (quarantined).
        data = (header, memoryview(rec.data))
        try:
            try:
                atomicfile.replace(path, data, tmp=tmp, fsync=False, fsync_dir=False,
                                   mode=0o600, publish=publish)
            except FileNotFoundError:
                # The fan-out directory was removed behind the agent: make it again (the
                # chunks it held are found gone by `vanished_keys`).
                self._make_subdir(path.parent)
                atomicfile.replace(path, data, tmp=tmp, fsync=False, fsync_dir=False,
                                   mode=0o600, publish=publish)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self._unhealthy = f"filesystem full: {e.strerror}"
            raise
        self._unhealthy = ""

    def publishing(self) -> contextlib.AbstractContextManager[bool]:
        """Hold off every write's publishing (its `wanted` check, rename and indexing) for
        the length of a `with` block."""
        return self._lock

    def delete(self, key: bytes) -> bool:
        if not self.forget(key):
            return False
        self.remove_file(key)
        return True

    def forget(self, key: bytes, entry: NvmeChunk | None = None) -> bool:
        """Take a chunk out of the index (cheap: the event loop calls it); the file stays
        until `remove_file`. Its slot is handed back on the event loop (`NvmeIndex.reap`),
        once the eviction queue has let go of it.

        With `entry` (a failed read's), only while the index still holds that entry: the
        key may have been dropped and written again since the read began, and the new
        file is good."""
        with self._lock:
            if entry is not None and self.index.get(key) != entry:
                return False
            size = self.index.unindex(key)
            if size < 0:
                return False
            self._used -= size
            return True

    def remove_file(self, key: bytes) -> None:
        """Unlink a forgotten chunk's file, unless the key was written again meanwhile."""
        with self._lock:
            if key not in self.index:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path_of(key))

    def vanished_keys(self) -> list[bytes]:
        """Indexed chunks whose fan-out directory was removed behind the agent (a listing
        of the root; the index is walked only when a directory is missing). They are
        forgotten by the caller, which also takes them out of its eviction order."""
        with self._lock:  # serialised with `_make_subdir`: a new directory is never missing
            try:
                present = {e.name for e in os.scandir(self.root) if e.is_dir()}
            except FileNotFoundError:
                present = set()
            missing = self._subdirs - present
            if not missing:
                return []
            self._subdirs -= missing
            return [k for k in self.index if k.hex()[:2] in missing]

    def keys(self) -> Iterable[bytes]:
        return list(self.index)

    def healthy(self) -> tuple[bool, str]:
        return (not self._unhealthy, self._unhealthy)

    # -- internals

    def _make_subdir(self, path: Path) -> None:
        with self._lock:
            path.mkdir(parents=True, exist_ok=True)  # parents: the root may be gone too
            self._subdirs.add(path.name)

    def _set_aside(self, key: bytes, path: Path) -> None:
        """Quarantine a forgotten chunk's file, unless the key was written again meanwhile
        (the new file is good: the bad one is gone with the rename)."""
        with self._lock:
            if key not in self.index:
                self._quarantine(path)

    def _quarantine(self, path: Path) -> None:
        """Move a bad file to quarantine/ (kept for inspection, within its budget)."""
        try:
            size = _tree_bytes(path)
            os.replace(path, self.quarantine / path.name)
        except OSError as e:
            log.error("cannot quarantine %s: %s; deleting it", path, e)
            _remove_tree(path)
            return
        with self._qlock:
            self._quarantined_bytes += size - self._quarantined.pop(path.name, 0)
            self._quarantined[path.name] = size
            self._trim_quarantine()

    def _scan_quarantine(self) -> None:
        with self._qlock:
            found = sorted((e.stat(follow_symlinks=False).st_mtime, e.name,
                            _tree_bytes(Path(e.path))) for e in os.scandir(self.quarantine))
            self._quarantined = OrderedDict((name, size) for _, name, size in found)
            self._quarantined_bytes = sum(self._quarantined.values())
            self._trim_quarantine()

    def _trim_quarantine(self) -> None:
        """Delete the oldest quarantined files past `QUARANTINE_SHARE` of the capacity."""
        budget = int(self._capacity * QUARANTINE_SHARE)
        while self._quarantined and self._quarantined_bytes > budget:
            name, size = self._quarantined.popitem(last=False)
            self._quarantined_bytes -= size
            _remove_tree(self.quarantine / name)
            log.info("quarantine over %d bytes: deleted %s", budget, name)


def _tree_bytes(path: Path) -> int:
    """Bytes a quarantined entry takes (a file, or a directory found where a chunk was)."""
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    return sum(f.lstat().st_size for f in path.rglob("*"))


def _remove_tree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)
