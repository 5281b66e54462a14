"""Replace a file whole: write a temporary file beside it, then rename it into place.

`rename` is atomic on POSIX file systems (NFS included): a reader, or the process that
starts after a crash, finds the old file or the new one, never a torn one. What a power
loss leaves depends on the syncs, which each caller chooses for what it promises:

- `fsync` (the file's bytes reach the disk, or the file server, before the rename): once the
  new name is visible, its bytes are there too. Without it, a power loss (or a reader on
  another node of a network file system) may find the new name over a hole.
- `fsync_dir` (the directory synced after the rename): the rename itself is on the disk when
  the call returns. Without it, a power loss may bring back the old file.

The temporary file is removed when anything fails, the rename included (the old file is
then untouched); only a crash of the process can leave it behind, under the name the caller
gave, which the caller's start-up removes or its next write reuses.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path


def replace(path: Path, data: Iterable[bytes | memoryview], *, tmp: Path, fsync: bool = True,
            fsync_dir: bool = True, mode: int = 0o666,
            publish: Callable[[Path, Path], None] = os.replace) -> None:
    """Make `path` hold the concatenation of `data`, through the temporary file `tmp` (in the
    same directory: a rename does not cross file systems). `tmp` is truncated if it exists (a
    fixed name left by a crash is reused). `mode` is filtered by the umask, as open() does.

    `publish(tmp, path)` does the rename (`os.replace` by default); a caller that must rename
    under its own lock, or record the new file as it lands, passes its own.
    """
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        with open(fd, "wb") as f:  # buffered: many small records cost few write(2) calls
            for buf in data:
                f.write(buf)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        publish(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync_dir:
        sync_dir(path.parent)


def sync_dir(path: Path) -> None:
    """Sync directory `path`: the names created, renamed or removed in it are on the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
