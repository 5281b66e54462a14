"""G4 on a shared POSIX mount (`file:///mnt/shared/...`): NFS, a parallel file system.

Layout: `<root>/<first key byte, 2 hex>/<key hex>.kvc`. The 256 fan-out
directories keep any one directory small (network file systems slow down on
huge directories) and are shared by every node, so no node owns a file.
Writes go to a uniquely named temporary file in the target directory and are
renamed into place: `rename` is atomic on POSIX file systems (NFS included),
so a reader on any node sees a whole chunk or none. The temporary name holds
a random id, not a pid, because pids repeat across nodes.

The store identifies itself by a marker file in its root (`STORE_MARKER`),
written when it is first initialised: an unmounted network file system leaves
an empty mount point, which would otherwise pass for an empty store (a delete
retried against it would count as done, every read as a plain miss). Once an
agent has seen the marker, a root without it is the mount gone, and the tier
is unhealthy until the marker is back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from . import base
from .base import ChunkRecord
from .shared import ObjectInfo, SharedChunkTier, key_of, object_name

if TYPE_CHECKING:
    from ..config import SharedTier
    from ..metrics import AgentMetrics

TMP_MARK = ".tmp-"
STORE_MARKER = ".kvpool-store"
"""In the store's root: this directory is a kvpool store (never listed as a chunk)."""
MARKER_RECHECK = 0.5
"""Seconds a marker seen stands for the store being there, for a read that misses: one
stat of the marker per miss would double a lookup's stats."""
_MARKER_TEXT = (b"A kvpool shared chunk store. Do not delete: without this file, agents take\n"
                b"the mount for absent.\n")

# Errors that say the mount as a whole is unusable, not that one file is bad.
_OUTAGE_ERRNOS = {
    errno.EIO: "I/O error",
    errno.ESTALE: "stale file handle",
    errno.ENOTCONN: "not connected",
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "full",
    errno.EDQUOT: "over quota",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ETIMEDOUT: "timed out",
    errno.EHOSTDOWN: "host down",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ENODEV: "no device",
}


def root_of(url: str) -> Path:
    """The directory of a `file:///path` URL."""
    parts = urlsplit(url)
    if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
        raise ValueError(f"{url!r} is not a file:///path URL")
    return Path(unquote(parts.path))


class FileSharedTier(SharedChunkTier):
    scheme = "file"
    presence_batch = 64  # a stat is microseconds: batching saves thread hand-offs

    def __init__(self, cfg: SharedTier, metrics: AgentMetrics | None = None) -> None:
        super().__init__(cfg, metrics)
        self.root = root_of(cfg.url)
        self.marker = self.root / STORE_MARKER
        self._marker_seen = 0.0
        """When `_mount_absent` last found the marker (monotonic seconds)."""
        self._marked = False
        """This agent has seen the store's marker (or written it): from now on a root
        without it is an absent mount, not an empty store."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._mark()
        except OSError as e:
            # Start unhealthy rather than crash: the mount may appear later.
            self._set_unhealthy(self._outage(e) or f"file error: {e}")

    def _mark(self) -> None:
        """Find the store's marker, or initialise the store by writing it (a root this
        agent has never seen marked: a new store, or one from before markers)."""
        if not os.path.exists(self.marker):
            try:
                with open(self.marker, "xb") as f:
                    f.write(_MARKER_TEXT)
            except FileExistsError:
                pass  # another node initialised it meanwhile
        self._marked = True

    def _mount_absent(self, *, seen_lately: bool = False) -> bool:
        """The root is there but not the store: its marker, seen before, is gone. With
        `seen_lately`, a marker seen in the last `MARKER_RECHECK` seconds still counts
        (a miss then costs no second stat)."""
        if not self._marked:
            return False
        now = time.monotonic()
        if seen_lately and now - self._marker_seen < MARKER_RECHECK:
            return False
        if os.path.exists(self.marker):
            self._marker_seen = now
            return False
        return True

    def path_of(self, key: bytes) -> Path:
        name = object_name(key)
        return self.root / name[:2] / name

    # -- store primitives

    def _store_head(self, key: bytes) -> bool:
        try:
            os.stat(self.path_of(key))
        except FileNotFoundError:
            if self._mount_absent(seen_lately=True):
                raise  # not a miss: the store is gone (an empty mount point)
            return False
        return True

    def _store_get(self, key: bytes) -> bytes | None:
        try:
            with open(self.path_of(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            if self._mount_absent(seen_lately=True):
                raise  # not a miss: the store is gone (an empty mount point)
            return None

    def _store_read(self, key: bytes) -> ChunkRecord | base.IntegrityError | None:
        # One pass, as G3 reads: each block hashed right after it is read, while it is in
        # cache (the whole blob and then `decode` read the chunk from memory twice).
        try:
            with open(self.path_of(key), "rb", buffering=0) as f:
                return base.read_chunk_file(f, expect_key=key)
        except FileNotFoundError:
            if self._mount_absent(seen_lately=True):
                raise  # not a miss: the store is gone (an empty mount point)
            return None
        except base.IntegrityError as e:
            return e

    def _store_put(self, rec: ChunkRecord) -> None:
        path = self.path_of(rec.key)
        if self._mount_absent():  # or the object would land in the empty mount point
            raise FileNotFoundError(errno.ENOENT, f"{STORE_MARKER} is gone", str(self.marker))
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for buf in base.encode(rec):
                    _write_all(fd, memoryview(buf))
                # The rename publishes the file to every node: its bytes must be
                # on the server first, or another node may read a hole.
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _store_delete(self, key: bytes) -> bool:
        try:
            os.unlink(self.path_of(key))
        except FileNotFoundError:
            if not self.root.is_dir() or self._mount_absent():
                raise  # the mount is gone, not the object: nothing was deleted
            return False
        return True

    def _store_list(self) -> Iterator[ObjectInfo]:
        for sub in sorted(os.scandir(self.root), key=lambda e: e.name):
            if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                info = _info(entry)
                if info is not None:
                    yield info

    def _store_remove(self, objs: Sequence[ObjectInfo]) -> int:
        failed = 0
        for obj in objs:
            try:
                os.unlink(obj.name)
            except FileNotFoundError:
                pass  # another node's gc or a reader's integrity check got there first
            except OSError:
                failed += 1
        return failed

    def _store_probe(self) -> None:
        st = os.statvfs(self.root)  # raises when the mount is gone or hung (-> timeout)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(errno.ENOENT, "shared directory is missing", str(self.root))
        if st.f_flag & os.ST_RDONLY:  # before access(): it says EACCES for a read-only mount
            raise OSError(errno.EROFS, "shared file system is mounted read-only", str(self.root))
        if not os.access(self.root, os.W_OK):
            raise PermissionError(errno.EACCES, "shared directory is not writable",
                                  str(self.root))
        if st.f_bavail == 0:
            raise OSError(errno.ENOSPC, "no space left", str(self.root))
        # Last: what the mount itself says (read-only, full) is the surer reason.
        if self._mount_absent():
            raise FileNotFoundError(errno.ENOENT, f"{STORE_MARKER} is gone from the store's "
                                    "root (an empty mount point?)", str(self.marker))
        if not self._marked:  # the store was unreachable at start: initialise it now
            self._mark()

    # -- failure classification

    def _outage(self, exc: BaseException) -> str | None:
        if not isinstance(exc, OSError):
            return None
        what = _OUTAGE_ERRNOS.get(exc.errno or 0)
        if what is None and isinstance(exc, FileNotFoundError):
            if not self.root.is_dir():
                what = "directory missing"  # the mount went away under us
            elif self._mount_absent():
                what = "store missing, the mount looks absent"  # an empty mount point
        if what is None:
            return None
        return f"shared filesystem {what}: {exc}"

    def _is_timeout(self, exc: BaseException) -> bool:
        return isinstance(exc, OSError) and exc.errno == errno.ETIMEDOUT

    def _is_full(self, exc: BaseException) -> bool:
        return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _write_all(fd: int, buf: memoryview) -> None:
    done = 0
    while done < len(buf):
        done += os.write(fd, buf[done:])


def _info(entry: os.DirEntry[str]) -> ObjectInfo | None:
    """A chunk file or a leftover temporary file; None for anything else."""
    if TMP_MARK in entry.name:
        key = None
    else:
        key = key_of(entry.name)
        if key is None:
            return None  # not ours: never listed, so gc never deletes it
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None  # deleted while listing
    return ObjectInfo(entry.path, key, st.st_size, st.st_mtime)
