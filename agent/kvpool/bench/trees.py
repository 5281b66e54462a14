"""Benchmarks that compare checkouts in one run (`benchmarks/peer_window.py`,
`benchmarks/slow_link.py`): agents started from another tree's sources, turn by turn, and
which commit each tree is."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def agents_from(tree: Path | None) -> Iterator[None]:
    """Agents started meanwhile run from `tree`'s sources (None: this process's)."""
    if tree is None:
        yield
        return
    old = os.environ.get("PYTHONPATH")
    # The tree's sources first; what the path held after them (where the dependencies may
    # be installed outside the environment, e.g. a --target directory).
    os.environ["PYTHONPATH"] = ":".join(
        [str(tree.resolve() / "agent"), str(tree.resolve() / "operator"), *filter(None, [old])])
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def commit_of(tree: Path) -> str:
    """The tree's short commit, `+dirty` where its tracked files differ from it."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *a], capture_output=True,
                              text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
