"""An unmounted shared file system leaves an empty mount point: real agents must not take
it for an empty store.

The store is a real bind mount (tests run as root, here and in CI). Unmounted, its mount
point is an empty directory: before the store marked itself, a delete retried against it
counted as done (the object came back with the mount, and another node served the deleted
chunk), and every read was a plain miss while the tier reported healthy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import yaml

from kvpool.agent.client import KVPoolClient
from kvpool.agent.gc import run_gc
from kvpool.agent.tiers.sharedfs import STORE_MARKER, read_marker
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


def store_dirs(tmp_path: Path) -> tuple[Path, Path]:
    """A store's directory and the empty mount point it is bound onto."""
    store, mount_point = tmp_path / "store", tmp_path / "mnt"
    store.mkdir()
    mount_point.mkdir()
    return store, mount_point


def test_an_unmounted_store_is_unavailable_and_a_delete_waits_for_it(tmp_path: Path) -> None:
    """The mount goes; agent A deletes a chunk and agent B reads it: both report the store
    absent (not an empty store), A keeps the delete and neither writes into the mount
    point; once the mount is back the object goes, and B never serves the deleted chunk."""
    store, mount_point = store_dirs(tmp_path)
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


def kvpool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.agent", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def queue(c: KVPoolClient) -> dict[str, int]:
    q: dict[str, int] = shared(c)["queue"]  # type: ignore[assignment]
    return q


def restart_with_the_mount_gone(stack: ExitStack, a: LocalAgent, mount_point: Path,
                                store_id: str) -> KVPoolClient:
    """Unmount the store and start the stopped agent `a` again: its shared tier must know
    the empty mount point for its absent store `store_id`. A client of the agent."""
    subprocess.run(["umount", str(mount_point)], check=True, capture_output=True)
    a.start()
    c = stack.enter_context(KVPoolClient(a.socket_path))
    assert not shared(c)["healthy"]
    reason = str(shared(c)["reason"])
    assert "the mount looks absent" in reason and store_id in reason, reason
    return c


def test_an_agent_started_while_the_mount_is_absent_knows_its_store_and_waits_for_it(
        tmp_path: Path) -> None:
    """An agent that has used the store restarts while the mount is gone: it does not take
    the empty mount point for a new store (it remembers the store's id on its node), so the
    tier starts unhealthy, writes nothing there and keeps a delete; with the mount back it
    recovers, on the same store, and the delete is done."""
    store, mount_point = store_dirs(tmp_path)
    key, other = os.urandom(16), os.urandom(16)
    with ExitStack() as stack:
        stack.enter_context(bind_mount(store, mount_point))
        a = node(stack, tmp_path, "a", mount_point)
        with KVPoolClient(a.socket_path) as c:
            store_id = read_marker(store / STORE_MARKER)
            assert store_id  # a brand-new store is initialised, with an id
            assert c.put(key, data_of(key))
            wait_until(lambda: queue(c)["written"] == 1, "the upload")
        a.stop(remove_arena=False)  # what a restart keeps: arena, journal, the stores seen

        c = restart_with_the_mount_gone(stack, a, mount_point, store_id)
        assert c.delete(key)  # kept in DRAM by the warm restart; the store's copy waits
        assert c.put(other, data_of(other))
        wait_until(lambda: queue(c)["dropped"] == 1, "the write to be dropped")
        assert not any(mount_point.iterdir())  # no marker, no chunk in the mount point

        stack.enter_context(bind_mount(store, mount_point))  # the mount comes back
        wait_until(lambda: shared(c)["healthy"], "the tier to recover")
        wait_until(lambda: not list(store.rglob("*.kvc")), "the kept delete")
        assert read_marker(store / STORE_MARKER) == store_id  # the same store, not a new one
        assert c.lookup([key]) == 0 and c.get(key) is None


def test_an_agent_with_nvme_knows_its_store_after_a_reboot_emptied_its_tmpfs(
        tmp_path: Path) -> None:
    """A node reboots and its file system does not come back with it: the tmpfs with the
    agent's arena, journal and record is empty, but the copy of the record in the NVMe
    directory tells the starting agent that the empty mount point is its absent store."""
    store, mount_point = store_dirs(tmp_path)
    with ExitStack() as stack:
        stack.enter_context(bind_mount(store, mount_point))
        workdir = tmp_path / "a"
        workdir.mkdir()
        cfg = workdir / "agent.yaml"
        cfg.write_text(yaml.safe_dump({"pool": "mount-test", "tiers": {
            "nvme": {"path": str(workdir / "nvme"), "size": "16Mi"},
            "shared": {"url": mount_point.as_uri(), "requestTimeout": "2s"}}}))
        a = stack.enter_context(
            LocalAgent("--no-lock", "--config", str(cfg), workdir=workdir, dram="16Mi"))
        store_id = read_marker(store / STORE_MARKER)
        a.stop()  # removes the arena, the journal and the record on the tmpfs: a reboot
        assert not a.arena_path.with_suffix(".stores").exists()

        subprocess.run(["umount", str(mount_point)], check=True, capture_output=True)
        a.start()
        c = stack.enter_context(KVPoolClient(a.socket_path))
        reason = str(shared(c)["reason"])
        assert "the mount looks absent" in reason and str(store_id) in reason, reason
        assert not any(mount_point.iterdir())

        stack.enter_context(bind_mount(store, mount_point))
        wait_until(lambda: shared(c)["healthy"], "the tier to recover")


def test_an_agent_with_a_state_dir_knows_its_store_after_a_reboot_emptied_its_tmpfs(
        tmp_path: Path) -> None:
    """No NVMe tier, but a state directory on disk (`stateDir`, made at the first start):
    after a reboot empties the tmpfs and the file system is not mounted again, the copy of
    the record there tells the starting agent that the empty mount point is its absent
    store. It writes nothing there, and recovers on the same store when the mount returns,
    writing the record beside the arena again."""
    store, mount_point = store_dirs(tmp_path)
    key = os.urandom(16)
    with ExitStack() as stack:
        stack.enter_context(bind_mount(store, mount_point))
        workdir = tmp_path / "a"
        workdir.mkdir()
        state = workdir / "state" / "pool"  # not there yet: the agent makes it
        cfg = workdir / "agent.yaml"
        cfg.write_text(yaml.safe_dump({"pool": "mount-test", "stateDir": str(state), "tiers": {
            "shared": {"url": mount_point.as_uri(), "requestTimeout": "2s"}}}))
        a = stack.enter_context(
            LocalAgent("--no-lock", "--config", str(cfg), workdir=workdir, dram="16Mi"))
        store_id = read_marker(store / STORE_MARKER)
        assert store_id and state.is_dir()
        a.stop()  # removes the arena, the journal and the record on the tmpfs: a reboot
        tmpfs_record = a.arena_path.with_suffix(".stores")
        assert not tmpfs_record.exists()

        c = restart_with_the_mount_gone(stack, a, mount_point, store_id)
        assert c.put(key, data_of(key))  # DRAM takes it; the store's write is refused
        wait_until(lambda: queue(c)["dropped"] == 1, "the write to be dropped")
        assert not any(mount_point.iterdir())  # no marker, no chunk in the mount point

        stack.enter_context(bind_mount(store, mount_point))  # the mount comes back
        wait_until(lambda: shared(c)["healthy"], "the tier to recover")
        assert read_marker(store / STORE_MARKER) == store_id  # the same store, not a new one
        assert not list(store.rglob("*.kvc"))  # the refused write stayed refused
        assert store_id in tmpfs_record.read_text()  # the copies agree again


def test_gc_all_keeps_a_mounted_stores_marker_and_never_marks_an_absent_one(
        tmp_path: Path) -> None:
    """`kvpool gc --all` empties the store but keeps its marker, so a running agent keeps
    using the emptied store; against an empty mount point it writes no marker, which would
    have the agent take the mount point for its store and write into it."""
    store, mount_point = store_dirs(tmp_path)
    key, other = os.urandom(16), os.urandom(16)
    with ExitStack() as stack:
        stack.enter_context(bind_mount(store, mount_point))
        a = node(stack, tmp_path, "a", mount_point)
        c = stack.enter_context(KVPoolClient(a.socket_path))
        store_id = read_marker(store / STORE_MARKER)
        assert c.put(key, data_of(key))
        wait_until(lambda: queue(c)["written"] == 1, "the upload")

        assert run_gc(mount_point.as_uri(), all_objects=True).deleted == 1  # `kvpool gc --all`
        assert read_marker(store / STORE_MARKER) == store_id  # still the same store
        assert c.put(other, data_of(other))  # the agent keeps writing to the emptied store
        wait_until(lambda: queue(c)["written"] == 2, "the upload after gc")
        assert shared(c)["healthy"]
        assert [p.name for p in store.rglob("*.kvc")] == [f"{other.hex()}.kvc"]

        subprocess.run(["umount", str(mount_point)], check=True, capture_output=True)
        assert c.delete(other)  # finds no object: the store is gone, the delete waits
        wait_until(lambda: not shared(c)["healthy"], "the tier to turn unhealthy")
        assert run_gc(mount_point.as_uri(), all_objects=True).deleted == 0
        assert not any(mount_point.iterdir())  # no marker written into the mount point

        stack.enter_context(bind_mount(store, mount_point))
        wait_until(lambda: shared(c)["healthy"], "the tier to recover")
        wait_until(lambda: not list(store.rglob("*.kvc")), "the retried delete")


def test_a_store_initialised_afresh_with_init_store_is_taken_up_by_an_agent_that_used_the_old(
        tmp_path: Path) -> None:
    """A deliberate wipe, marker and all: an agent that used the old store takes the bare
    root for an absent mount, even across a restart, until `kvpool gc --init-store` marks it
    as a new store; the agent then uses the new store, and says so."""
    store = tmp_path / "store"
    store.mkdir()
    key = os.urandom(16)
    with ExitStack() as stack:
        a = node(stack, tmp_path, "a", store)
        old_id = read_marker(store / STORE_MARKER)
        a.stop(remove_arena=False)
        shutil.rmtree(store)  # the operator wipes the store
        store.mkdir()
        a.start()
        c = stack.enter_context(KVPoolClient(a.socket_path))
        assert "the mount looks absent" in str(shared(c)["reason"])
        assert not any(store.iterdir())

        run = kvpool("gc", "--shared", store.as_uri(), "--init-store", "--json")
        assert run.returncode == 0, run.stderr
        [mark] = json.loads(run.stdout)["stores"]
        assert mark["created"] and mark["id"] != old_id
        assert read_marker(store / STORE_MARKER) == mark["id"]
        wait_until(lambda: shared(c)["healthy"], "the agent to take up the new store")
        assert f"the store is a new one (id {mark['id']}; this agent used id {old_id})" in a.log()
        assert c.put(key, data_of(key))
        wait_until(lambda: queue(c)["written"] == 1, "the upload")
        assert len(list(store.rglob("*.kvc"))) == 1

        again = kvpool("gc", "--shared", store.as_uri(), "--init-store")  # already a store
        assert again.returncode == 0, again.stderr
        assert f"already marked {store.as_uri()} as a kvpool store (id {mark['id']})" \
            in again.stdout


def test_another_store_mounted_in_the_stores_place_gets_no_write_serves_no_read_and_waits(
        tmp_path: Path) -> None:
    """Another store (its own marker, its own chunks) is mounted over the store a live agent
    uses, three times, and each time the agent's first request notices, before it lands
    there: a write uploads nothing into it, a read serves none of its chunks (a miss), a
    delete removes none of its files; the tier turns unhealthy with the reason. Once the
    agent's own store is back (the other one unmounted), it recovers and uses its own: the
    kept delete lands there."""
    store, mount_point = store_dirs(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    mine, theirs, refused = os.urandom(16), os.urandom(16), os.urandom(16)
    with ExitStack() as stack:
        b = shared_node(stack, tmp_path, "b", other, pool="other-pool")
        with KVPoolClient(b.socket_path) as cb:  # the other store holds `mine` too
            assert cb.put(theirs, data_of(theirs)) and cb.put(mine, data_of(mine))
            wait_until(lambda: queue(cb)["written"] == 2, "the other store's uploads")
        b.stop()
        other_id = read_marker(other / STORE_MARKER)
        other_files = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}

        stack.enter_context(bind_mount(store, mount_point))
        a = node(stack, tmp_path, "a", mount_point)
        c = stack.enter_context(KVPoolClient(a.socket_path))
        store_id = read_marker(store / STORE_MARKER)
        assert store_id and other_id and store_id != other_id
        assert c.put(mine, data_of(mine))
        wait_until(lambda: queue(c)["written"] == 1, "the upload")

        def swapped(first_request: Callable[[], object]) -> None:
            """Mount the other store over the agent's, make `first_request`, and check
            that the tier turned unhealthy for it; then unmount it and wait for the
            agent to take its own store up again."""
            with bind_mount(other, mount_point):
                assert read_marker(mount_point / STORE_MARKER) == other_id
                first_request()
                wait_until(lambda: not shared(c)["healthy"], "the tier to turn unhealthy")
                reason = str(shared(c)["reason"])
                assert "another store is mounted" in reason, reason
                assert other_id in reason and store_id in reason, reason
                assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == \
                    other_files  # nothing written into it, nothing deleted from it
            wait_until(lambda: shared(c)["healthy"], "the tier to recover on its own store")

        def write() -> None:
            assert c.put(refused, data_of(refused))
            wait_until(lambda: queue(c)["dropped"] == 1, "the upload to be refused")

        swapped(write)
        swapped(lambda: c.get(theirs) is None or pytest.fail("served the other store's chunk"))
        swapped(lambda: c.delete(mine) or pytest.fail("the delete was refused"))

        assert "another store is mounted" in a.log()  # the warning says it too
        wait_until(lambda: not list(store.rglob("*.kvc")), "the kept delete, in its own store")
        assert read_marker(store / STORE_MARKER) == store_id
        assert c.put(theirs, data_of(theirs))  # its own store takes writes again
        wait_until(lambda: queue(c)["written"] == 2, "an upload to its own store")
        assert [p.name for p in store.rglob("*.kvc")] == [f"{theirs.hex()}.kvc"]
