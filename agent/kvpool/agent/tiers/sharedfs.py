"""G4 on a shared POSIX mount (`file:///mnt/shared/...`): NFS, a parallel file system.

Layout: `<root>/<first key byte, 2 hex>/<key hex>.kvc`. The 256 fan-out
directories keep any one directory small (network file systems slow down on
huge directories) and are shared by every node, so no node owns a file.
Writes go to a uniquely named temporary file in the target directory and are
renamed into place: `rename` is atomic on POSIX file systems (NFS included),
so a reader on any node sees a whole chunk or none. The temporary name holds
a random id, not a pid, because pids repeat across nodes.

The store identifies itself by a marker file in its root (`STORE_MARKER`),
written when it is first initialised and holding a store id: an unmounted
network file system leaves an empty mount point, which would otherwise pass for
an empty store (a delete retried against it would count as done, every read as
a plain miss). Once an agent has seen the marker, a root without it is the mount
gone, and the tier is unhealthy until the marker is back. The agent records the
ids it has seen on its node (`SeenStores`), so an agent that starts while the
mount is absent knows it too, and never initialises the mount point as a store.

Every write and delete, and every read before it is served, first checks that the
marker is still the store's (one stat: its id is read again only when the file is
another), so a store swapped under the agent (another file system mounted in the
store's place) takes no write, loses no chunk and serves no read: the tier is
unhealthy until the agent's own store is back. A marker with another id where the
root was seen unmarked (the store wiped, then marked afresh with `init_store`), or
found at start, is the store initialised afresh: the agent uses it, and says so.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from .. import atomicfile
from . import base
from .base import ChunkRecord
from .shared import ObjectInfo, SharedChunkTier, key_of, object_name

if TYPE_CHECKING:
    from ..config import SharedTier
    from ..metrics import AgentMetrics
    from ..seenstores import SeenStores

log = logging.getLogger("kvpool.agent")

TMP_MARK = ".tmp-"
STORE_MARKER = ".kvpool-store"
"""In the store's root: this directory is a kvpool store (never listed as a chunk)."""
MARKER_RECHECK = 0.5
"""Seconds a marker seen stands for the store being there, for a presence check or a read
that misses: one stat of the marker per miss would double a lookup's stats."""
_MARKER_TEXT = (b"A kvpool shared chunk store. Do not delete: without this file, agents take\n"
                b"the mount for absent.\n")
_ID_FIELD = b"id: "
"""The marker's line with the store's id (a marker from before ids has none: id "")."""
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP}
"""What link() says on a file system without hard links."""

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


def init_store(root: Path) -> tuple[str, bool]:
    """Mark the existing directory `root` as a store, unless it is one: (its id, whether
    this call marked it). The explicit way to tell agents that have used a store here
    that an unmarked root is their store again (a new file system in the old one's place,
    a marker deleted by hand): they take the new id for the store's."""
    if not root.is_dir():  # never made here: it would be made in a mount point's place
        raise FileNotFoundError(errno.ENOENT, "no such directory", str(root))
    found = read_marker(root / STORE_MARKER)
    if found is not None:
        return found, False
    return _write_marker(root)


class OtherStoreMounted(OSError):
    """The store's root holds another store's marker: another file system is mounted in
    the place of the store this agent uses."""


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    """What tells one marker file from another: a marker is never rewritten in place, and
    its mtime tells a new file that got an old one's inode number."""
    return st.st_dev, st.st_ino, st.st_mtime_ns


def read_marker(marker: Path) -> str | None:
    """The store id in `marker`; "" for a marker from before ids; None when there is none."""
    try:
        with open(marker, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    for line in text.splitlines():
        if line.startswith(_ID_FIELD):
            return line[len(_ID_FIELD):].strip().decode("ascii", "replace")
    return ""


def _write_marker(root: Path) -> tuple[str, bool]:
    """Initialise the store at `root` with a new id: (the store's id, whether it is ours).

    The marker appears whole (written aside, then linked into place, which fails if it
    exists): another node reading it meanwhile never sees it without its id, and of two
    nodes initialising the store at once one wins and both use its id. (Not
    `atomicfile.replace`: a rename would replace a marker another node has just written.)"""
    store_id = uuid.uuid4().hex
    marker = root / STORE_MARKER
    text = _MARKER_TEXT + _ID_FIELD + store_id.encode() + b"\n"
    tmp = root / f"{STORE_MARKER}{TMP_MARK}{store_id}"
    try:
        with open(tmp, "xb") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, marker)
        except FileExistsError:
            found = read_marker(marker)
            if found is None:  # gone again at once: nothing to agree on
                raise FileNotFoundError(errno.ENOENT, f"{STORE_MARKER} vanished",
                                        str(marker)) from None
            return found, False
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                raise
            try:  # no hard links: created whole only here, and a reader may see it empty
                with open(marker, "xb") as f:
                    f.write(text)
            except FileExistsError:
                return read_marker(marker) or "", False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return store_id, True


class FileSharedTier(SharedChunkTier):
    scheme = "file"
    presence_batch = 64  # a stat is microseconds: batching saves thread hand-offs

    def __init__(self, cfg: SharedTier, metrics: AgentMetrics | None = None, *,
                 seen: SeenStores | None = None, initialise: bool = True) -> None:
        """`seen`: the agent's record of the stores it has used (None: none kept).
        `initialise`: mark a root without a marker as a new store (False for tools that
        only read or delete, such as gc: they never make a directory a store)."""
        super().__init__(cfg, metrics)
        self.root = root_of(cfg.url)
        self.marker = self.root / STORE_MARKER
        self._seen = seen
        self._record_as = self.root.as_uri()
        """The store's URL in the record, spelt one way (`file:///a/b/` is `file:///a/b`)."""
        self._initialise = initialise
        self._marker_seen = 0.0
        """When the store's marker was last found as it should be (monotonic seconds)."""
        self._marker_file: tuple[int, int, int] | None = None
        """`_identity` of the marker file whose id is the store's: while it is the one in
        the root, a stat proves the store is there without reading the id again."""
        self._may_take_new_id = True
        """A marker with another id than the store's is the store marked afresh, taken up:
        at start, and after the root was seen without a marker (`init_store` after a
        wipe). Otherwise, another store mounted in its place, refused."""
        self.store_id = seen.id_of(self._record_as) if seen is not None else None
        """The id of the store this agent uses here ("": a marker from before ids); None
        until it has seen one."""
        self._marked = self.store_id is not None
        """This agent has seen the store's marker (or written it), now or in an earlier run:
        from now on a root without it is an absent mount, not an empty store."""
        try:
            if not self._marked and initialise:
                self.root.mkdir(parents=True, exist_ok=True)
            self._mark()
        except OSError as e:
            # Start unhealthy rather than crash: the mount may appear later.
            self._set_unhealthy(self._outage(e) or f"file error: {e}")

    def _mark(self) -> None:
        """Find the store's marker and take its id; or, in a root never seen marked (a new
        store, or one from before markers), initialise the store by writing it.

        Raises FileNotFoundError when the marker of a store this agent has used is gone,
        OtherStoreMounted when another store's is there in a running agent (see
        `_may_take_new_id`)."""
        try:
            st: os.stat_result | None = os.stat(self.marker)  # before the id: see _verify
        except FileNotFoundError:
            st = None
        found = None if st is None else read_marker(self.marker)
        if found is None or st is None:
            if self._marked:
                raise self._gone()
            if not self._initialise:
                return
            found, _ = _write_marker(self.root)
            st = os.stat(self.marker)
        if self.store_id is not None and found != self.store_id:
            if not self._may_take_new_id:
                raise self._other(found)
            log.warning("shared tier %s: the store is a new one (id %s; this agent used id %s):"
                        " initialised afresh, it is used from now on", self.url,
                        found or "from before ids", self.store_id or "from before ids")
        self.store_id = found
        self._marked = True
        self._may_take_new_id = False
        self._marker_file = _identity(st)
        if self._seen is not None:
            self._seen.remember(self._record_as, found)

    def _gone(self) -> FileNotFoundError:
        self._may_take_new_id = True
        return FileNotFoundError(
            errno.ENOENT, f"{STORE_MARKER} is gone from the root of a store this agent has "
            f"used (id {self.store_id or 'from before ids'}): an empty mount point?",
            str(self.marker))

    def _other(self, found: str) -> OtherStoreMounted:
        return OtherStoreMounted(
            f"{self.marker} names store {found or 'from before ids'}, this agent uses store "
            f"{self.store_id or 'from before ids'}: mount that one back (or, if the store was "
            f"marked afresh in its place, restart the agent)")

    def _verify(self, *, seen_lately: bool = False) -> None:
        """Raise unless the root holds the store this agent uses: FileNotFoundError when
        its marker is gone (an empty mount point), OtherStoreMounted when another store's
        marker is there (another file system mounted in its place). One stat while the
        marker is the file last seen; its id is read again only when the file is another.
        With `seen_lately`, a marker found in the last `MARKER_RECHECK` seconds still
        counts (no stat at all)."""
        if not self._marked:
            return
        now = time.monotonic()
        if seen_lately and now - self._marker_seen < MARKER_RECHECK:
            return
        try:
            # The stat before the id: a marker replaced between the two is read again next
            # time (the id read is then the newer file's, the identity the older one's).
            st = os.stat(self.marker)
        except FileNotFoundError:
            raise self._gone() from None
        if _identity(st) != self._marker_file:
            found = read_marker(self.marker)
            if found is None:
                raise self._gone()
            if found != self.store_id:
                raise self._other(found)
            self._marker_file = _identity(st)  # the same store, remounted or restored
        self._marker_seen = now

    def _mount_absent(self) -> bool:
        """The root is there but not the store: its marker, seen before, is gone."""
        if not self._marked or os.path.exists(self.marker):
            return False
        self._may_take_new_id = True
        return True

    def path_of(self, key: bytes) -> Path:
        name = object_name(key)
        return self.root / name[:2] / name

    # -- store primitives

    def _store_head(self, key: bytes) -> bool:
        try:
            os.stat(self.path_of(key))
        except FileNotFoundError:
            self._verify(seen_lately=True)  # raises if not a miss: the store is gone
            return False
        # A presence answer, not bytes: the marker of the last half second stands (a read
        # that follows checks it again).
        self._verify(seen_lately=True)
        return True

    def _store_get(self, key: bytes) -> bytes | None:
        try:
            with open(self.path_of(key), "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            self._verify(seen_lately=True)  # raises if not a miss: the store is gone
            return None
        self._verify()  # before it is served: the file may be another store's
        return blob

    def _store_read(self, key: bytes) -> ChunkRecord | base.IntegrityError | None:
        # One pass, as G3 reads: each block hashed right after it is read, while it is in
        # cache (the whole blob and then `decode` read the chunk from memory twice).
        got: ChunkRecord | base.IntegrityError
        try:
            with open(self.path_of(key), "rb", buffering=0) as f:
                got = base.read_chunk_file(f, expect_key=key)
        except FileNotFoundError:
            self._verify(seen_lately=True)  # raises if not a miss: the store is gone
            return None
        except base.IntegrityError as e:
            got = e
        # Before it is served, or its object is called damaged (and removed): the file
        # may be another store's, mounted in this one's place since the last look.
        self._verify()
        return got

    def _store_put(self, rec: ChunkRecord) -> None:
        path = self.path_of(rec.key)
        self._verify()  # or the object would land in an empty mount point, or another store
        path.parent.mkdir(exist_ok=True)
        # The rename publishes the file to every node: its bytes must be on the server
        # first (fsync), or another node may read a hole. The directory is not synced: a
        # rename the server loses in a crash is a chunk missing from a cache, a miss.
        atomicfile.replace(path, base.encode(rec), tmp=path.with_name(
            f"{path.name}{TMP_MARK}{uuid.uuid4().hex}"), fsync_dir=False, mode=0o644)

    def _store_delete(self, key: bytes) -> bool:
        self._verify()  # another store's copy of the chunk is not this store's to delete
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
        # Last: what the mount itself says (read-only, full) is the surer reason. The
        # marker's id too: a store initialised afresh while the mount was away is used (and
        # recorded) from now on, another store in its place keeps the tier unhealthy; a
        # store unreachable at start is initialised now.
        self._mark()

    # -- failure classification

    def _outage(self, exc: BaseException) -> str | None:
        if isinstance(exc, OtherStoreMounted):
            return f"shared filesystem another store is mounted: {exc}"
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
