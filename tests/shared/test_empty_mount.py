"""An unmounted shared file system leaves an empty mount point: real agents must not take
it for an empty store.

The store is a real bind mount (tests run as root, here and in CI). Unmounted, its mount
point is an empty directory: before the store marked itself, a delete retried against it
counted as done (the object came back with the mount, and another node served the deleted
chunk), and every read was a plain miss while the tier reported healthy.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from kvpool.agent.client import KVPoolClient
from kvpool.agent.tiers.sharedfs import STORE_MARKER
from kvpool.bench.local import LocalAgent

from ..support import shared_node, wait_until

CHUNK = 64 * 1024


def data_of(key: bytes) -> bytes:
    return (key * (CHUNK // len(key)))[:CHUNK]


def mount_cmd(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode:
        pytest.fail(f"this test needs real bind mounts (run it as root): mount {' '.join(args)}"
                    f" said {done.stderr.strip() or done.returncode}")


@contextmanager
def bind_mount(store: Path, mount_point: Path) -> Iterator[None]:
    mount_cmd("--bind", str(store), str(mount_point))
    try:
        yield
    finally:
        subprocess.run(["umount", str(mount_point)], capture_output=True)


def node(stack: ExitStack, root: Path, name: str, mount_point: Path) -> LocalAgent:
    return shared_node(stack, root, name, mount_point, pool="mount-test")


def shared(c: KVPoolClient) -> dict[str, object]:
    tier: dict[str, object] = c.stats()["tiers"]["shared"]
    return tier


def test_an_unmounted_store_is_unavailable_and_a_delete_waits_for_it(tmp_path: Path) -> None:
    """The mount goes; agent A deletes a chunk and agent B reads it: both report the store
    absent (not an empty store), A keeps the delete and neither writes into the mount
    point; once the mount is back the object goes, and B never serves the deleted chunk."""
    store, mount_point = tmp_path / "store", tmp_path / "mnt"
    store.mkdir()
    mount_point.mkdir()
    key = os.urandom(16)
    with ExitStack() as stack:
        stack.enter_context(bind_mount(store, mount_point))
        a = node(stack, tmp_path, "a", mount_point)
        b = node(stack, tmp_path, "b", mount_point)
        ca = stack.enter_context(KVPoolClient(a.socket_path))
        cb = stack.enter_context(KVPoolClient(b.socket_path))
        assert (store / STORE_MARKER).is_file()  # the first agent initialised the store
        assert ca.put(key, data_of(key))
        wait_until(lambda: shared(ca)["queue"]["written"] == 1, "the upload")  # type: ignore[index]
        assert len(list(store.rglob("*.kvc"))) == 1

        subprocess.run(["umount", str(mount_point)], check=True, capture_output=True)
        assert not any(mount_point.iterdir())  # what an unmounted file system leaves
        assert ca.delete(key)  # A's delete finds no object: the store is gone, not it
        assert cb.get(key) is None  # B's read finds no object: the store is gone, not it
        for agent, c in ((a, ca), (b, cb)):
            wait_until(lambda c=c: not shared(c)["healthy"], "the tier to turn unhealthy")
            reason = str(shared(c)["reason"])
            assert "the mount looks absent" in reason, reason
            assert "the mount looks absent" in agent.log()  # the warning says it too
        assert not any(mount_point.iterdir())  # nothing written into the mount point

        stack.enter_context(bind_mount(store, mount_point))  # the mount comes back
        wait_until(lambda: not list(store.rglob("*.kvc")), "the retried delete")
        for c in (ca, cb):
            wait_until(lambda c=c: shared(c)["healthy"], "the tier to recover")
            assert c.lookup([key]) == 0 and c.get(key) is None
