"""An arena on hugetlbfs (`hugePages`), on real huge pages and a real hugetlbfs mount (tests
run as root, here and in CI). hugetlbfs maps files but takes no write(2), so the arena's
journal, lock file and store record live on a tmpfs instead: `journalDir`, by default
/dev/shm. Before, the agent could not start on such an arena at all ("Invalid argument":
its lock file was written beside the arena)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.agent.config import load_agent_config
from kvpool.bench.local import LocalAgent

from .test_tenants import hello

# The huge-page reservation and its free count are the machine's, not the test's.
pytestmark = pytest.mark.alone

HUGE_PAGES = Path("/sys/kernel/mm/hugepages/hugepages-2048kB")
ARENA_PAGES = 8  # a 16 MiB arena of 2 MiB pages
_RESERVING = Path(tempfile.gettempdir()) / "kvpool-tests-hugepages.lock"
"""Held while a test changes the pool of huge pages, so tests run side by side (pytest-xdist)
add and take back only their own pages."""


def _free_pages() -> int:
    return int((HUGE_PAGES / "free_hugepages").read_text())


def _add_huge_pages(n: int) -> None:
    """Grow the kernel's pool of 2 MiB pages by n (negative: shrink it), whatever other
    tests hold."""
    reserved = HUGE_PAGES / "nr_hugepages"
    with open(_RESERVING, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        reserved.write_text(str(int(reserved.read_text()) + n))


@pytest.fixture
def hugetlbfs(tmp_path: Path) -> Iterator[Path]:
    """A hugetlbfs mount of 2 MiB pages, limited to one arena, with that many pages added to
    the kernel's pool for the test and taken back after it."""
    try:
        _add_huge_pages(ARENA_PAGES)
    except OSError as e:  # no 2 MiB pages in this kernel, or sysfs not writable
        pytest.fail(f"this test needs 2 MiB huge pages (run it as root): {e}")
    mount = tmp_path / "hugepages"
    mount.mkdir()
    try:
        assert _free_pages() >= ARENA_PAGES, "the kernel could not reserve the huge pages"
        done = subprocess.run(["mount", "-t", "hugetlbfs", "-o",
                               f"pagesize=2M,size={ARENA_PAGES * 2}M", "none", str(mount)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.fail(f"this test needs a hugetlbfs mount (run it as root): {done.stderr}")
        try:
            yield mount
        finally:
            subprocess.run(["umount", str(mount)], capture_output=True)
    finally:
        _add_huge_pages(-ARENA_PAGES)


def _agent(tmp_path: Path, arena: Path, journal_dir: Path | None) -> LocalAgent:
    dram: dict[str, object] = {"path": str(arena), "hugePages": True}
    if journal_dir is not None:
        dram["journalDir"] = str(journal_dir)
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({"pool": "huge", "tiers": {"dram": dram}}))
    return LocalAgent("--no-lock", "--config", str(config), workdir=tmp_path, dram="16Mi",
                      arena=arena)


@pytest.mark.parametrize("journal_dir", [None, "journal"], ids=["in-dev-shm", "journalDir"])
def test_an_arena_on_hugetlbfs_serves_restarts_warm_and_is_cleaned_up(
        tmp_path: Path, hugetlbfs: Path, journal_dir: str | None) -> None:
    arena = hugetlbfs / "arena"
    journals = tmp_path / journal_dir if journal_dir else None
    agent = _agent(tmp_path, arena, journals)
    cfg = load_agent_config(tmp_path / "agent.yaml")  # what the agent runs with
    side = [cfg.journal_path(), cfg.lock_path()]
    assert all(p.parent == (journals or Path("/dev/shm")) for p in side)
    keys = [os.urandom(16) for _ in range(12)]
    try:
        with agent:
            for mode in ("zero_copy", "inline"):
                with KVPoolClient(agent.socket_path, mode=mode) as c:
                    for k in keys[:6] if mode == "zero_copy" else keys[6:]:
                        assert c.put(k, k * 4096)
            assert os.listdir(hugetlbfs) == ["arena"]  # nothing else is written there
            assert all(p.exists() for p in side)
            agent.stop(remove_arena=False)
            agent.start()  # a warm restart: the journal finds every chunk in the arena
            with KVPoolClient(agent.socket_path) as c:
                assert [c.get(k) == k * 4096 for k in keys] == [True] * len(keys)
            agent.stop(remove_arena=False)
        out = subprocess.run([sys.executable, "-m", "kvpool.agent", "cleanup", "--config",
                              str(tmp_path / "agent.yaml"), "--socket", str(agent.socket_path),
                              "--arena", str(arena)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert not arena.exists() and not any(p.exists() for p in side), out.stdout
    finally:
        agent.stop()
        for p in side:
            p.unlink(missing_ok=True)


CHUNK = 1 << 20


def test_a_client_resizing_a_huge_page_arena_never_faults_the_agent(
        tmp_path: Path, hugetlbfs: Path) -> None:
    """A client shrinks the arena through the fd its HELLO got, again and again, while
    another stores and reads chunks inline (every byte of which the agent writes, reads
    and hashes itself). The agent wrote and hashed through its mapping: a shrink landing in
    the copy was SIGBUS, the agent gone. Now the kernel writes for it and a lost page is an
    error code: it puts the file back and goes on; the lost chunks are misses."""
    arena = hugetlbfs / "arena"
    agent = _agent(tmp_path, arena, tmp_path / "journal")
    stop = threading.Event()
    shrinks = 0

    def shrink_in_a_loop(fd: int) -> None:
        nonlocal shrinks
        while not stop.is_set():
            os.ftruncate(fd, 0)  # what the agent maps past now is gone
            shrinks += 1

    with agent:
        reply, fds = hello(agent.socket_path, "")
        assert isinstance(reply, p.HelloReply) and len(fds) == 1
        shrinker = threading.Thread(target=shrink_in_a_loop, args=(fds[0],), daemon=True)
        shrinker.start()
        try:
            with KVPoolClient(agent.socket_path, mode="inline") as c:
                for _ in range(300):
                    key, data = os.urandom(16), os.urandom(CHUNK)
                    c.put(key, data)  # stored, or not when no room was left
                    got = c.get(key)
                    assert got in (None, data), "a read served bytes the chunk never had"
        finally:
            stop.set()
            shrinker.join()
            os.close(fds[0])
        assert agent.proc is not None and agent.proc.poll() is None, agent.log()
        assert shrinks > 300
        # The arena is back to its size and serves whole chunks again.
        with KVPoolClient(agent.socket_path) as c:
            assert c.stats()["tiers"]["dram"]["healthy"]
            for _ in range(4):
                key, data = os.urandom(16), os.urandom(CHUNK)
                assert c.put(key, data)
                assert c.get(key, verify=True) == data
        assert arena.stat().st_size == ARENA_PAGES * 2 * CHUNK
        assert "resized" in agent.log()
