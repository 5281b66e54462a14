"""Hand a pool's host directories to the agent's UID: the agent pods' init container.

kubelet creates `hostPath` directories (`DirectoryOrCreate`) owned by root, and
`fsGroup` does not apply to host paths, so a non-root agent could not create its
socket, arena or chunk files in them. The init container
(`python3 -m kvpool.operator.hostdirs --owner UID:GID DIR...`) runs as root with
only the `CHOWN` and `DAC_READ_SEARCH` capabilities, changes the owner, and exits;
the agent container itself never runs as root.

A directory already owned by the agent is left alone, contents included: the agent
creates everything inside as itself, so only a new directory, or one left by an
agent that ran as another user (an upgrade from a root agent), is walked. That keeps
a restart cheap on an NVMe tier with a million chunk files.

With `--remove` it does the opposite, for a deleted pool (`spec.nodeReclaimPolicy:
Delete`): the init container of the pool's reclaim DaemonSet
(`python3 -m kvpool.operator.hostdirs --remove DIR...`), run once the pool's agents are
gone, removes the pool's directories with the same two capabilities: it gives each
directory of the tree back to root (the agent's UID owns them, and root without
`DAC_OVERRIDE` may not write in them), then deletes the tree.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn


def parse_owner(text: str) -> tuple[int, int]:
    """`UID:GID` (or `UID`, meaning the same GID) as two non-negative integers."""
    uid_text, _, gid_text = text.partition(":")
    try:
        uid, gid = int(uid_text), int(gid_text or uid_text)
    except ValueError:
        raise ValueError(f"owner {text!r} is not UID[:GID]") from None
    if uid < 0 or gid < 0:
        raise ValueError(f"owner {text!r} is negative")
    return uid, gid


def owned_by(st: os.stat_result, uid: int, gid: int) -> bool:
    return st.st_uid == uid and st.st_gid == gid


def _tree(top: Path) -> Iterator[Path]:
    """`top` and everything below it, without following symbolic links."""
    yield top
    for root, dirs, files in os.walk(top, followlinks=False):
        for name in (*dirs, *files):
            yield Path(root) / name


def prepare(directory: Path, uid: int, gid: int) -> int:
    """Make `directory` (created if missing) and its contents owned by uid:gid.

    Returns how many entries changed owner. A directory already owned by uid:gid is not
    walked (see the module's docstring).
    """
    directory.mkdir(parents=True, exist_ok=True)
    if owned_by(directory.lstat(), uid, gid):
        return 0
    changed = 0
    for path in _tree(directory):
        st = path.lstat()
        if owned_by(st, uid, gid):
            continue
        # lchown: a symbolic link planted in a host directory must not hand its target over.
        os.lchown(path, uid, gid)
        changed += 1
    return changed


def remove(directory: Path) -> int:
    """Delete `directory` and everything below it (nothing if it is missing), without
    following symbolic links; returns how many entries were removed."""
    if len(directory.resolve().parts) < 3:  # "/" or "/x": never a pool's directory
        raise ValueError(f"{directory} is not a pool's directory")
    try:
        top = directory.lstat()
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(top.st_mode):
        raise NotADirectoryError(f"{directory} is not a directory")
    for path in _tree(directory):
        if path.is_dir() and not path.is_symlink():
            os.lchown(path, 0, 0)  # its owner may write in it: root, from now on
            os.chmod(path, 0o700)
    removed = sum(1 for _ in _tree(directory))
    shutil.rmtree(directory)
    return removed


USAGE = "python3 -m kvpool.operator.hostdirs (--owner UID:GID | --remove) DIR..."


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line (an init container's log shows it whole), not argparse's usage block:
        what is wrong, then how it is called."""
        self.exit(2, f"kvpool hostdirs: {message} (usage: {USAGE})\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(
        prog="python3 -m kvpool.operator.hostdirs", usage=USAGE,
        description="Give the kvpool agent's host directories to its UID:GID, or remove "
        "a deleted pool's.",
    )
    parser.add_argument("--owner", help="UID:GID of the agent")
    parser.add_argument("--remove", action="store_true",
                        help="delete the directories instead (a deleted pool's)")
    parser.add_argument("directories", nargs="+", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    if args.remove:
        for directory in args.directories:
            try:
                removed = remove(directory)
            except (OSError, ValueError) as e:
                print(f"kvpool hostdirs: {directory}: {e}", file=sys.stderr)
                return 1
            print(f"kvpool hostdirs: {directory}: removed ({removed} entries)")
        return 0
    if args.owner is None:
        parser.error("--owner is required (or --remove)")
    try:
        uid, gid = parse_owner(args.owner)
    except ValueError as e:
        parser.error(str(e))
    for directory in args.directories:
        try:
            changed = prepare(directory, uid, gid)
        except OSError as e:
            print(f"kvpool hostdirs: {directory}: {e}", file=sys.stderr)
            return 1
        print(f"kvpool hostdirs: {directory}: owner {uid}:{gid} ({changed} entries changed)")
    return 0


if __name__ == "__main__":  # pragma: no cover - run as the init container
    sys.exit(main())
