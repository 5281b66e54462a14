"""G3 through a real agent: chunk files on a real directory (and a real, small tmpfs).

The DRAM arena is a few MiB so that writes push chunks down to NVMe. Prefetch is off unless a
test is about it: with it on, a LOOKUP that finds a chunk in NVMe also moves it up, and the
tests use LOOKUP to see where chunks are.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.agent.tiers.base import HEADER_BYTES
from kvpool.bench.local import LocalAgent

from ..support import flip_last_byte
from .conftest import RawConn, scrape, wait_until

KiB, MiB = 1 << 10, 1 << 20
NO_PREFETCH = "prefetch: {enabled: false}\n"


def series(name: str, **labels: str) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in
                                 sorted({"pool": "default", **labels}.items())) + "}"


DEMOTED = series("kvpool_tier_demotions_total", tier="dram")
PROMOTED = series("kvpool_tier_promotions_total", tier="nvme")
PREFETCHED = series("kvpool_tier_prefetches_total", tier="nvme")
BAD_NVME = series("kvpool_integrity_failures_total", tier="nvme")
NVME_FULL = series("kvpool_tier_errors_total", kind="full", tier="nvme")
NVME_HEALTHY = series("kvpool_tier_healthy", tier="nvme")


def data_for(key: bytes, size: int) -> bytes:
    """Each chunk's bytes derive from its key, so a wrong chunk never passes for a right one."""
    return (key * (size // len(key) + 1))[:size]


def nvme_agent(tmp_path: Path, policy: str = NO_PREFETCH, dram: str = "4Mi",
               nvme_dir: Path | None = None) -> LocalAgent:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(policy)
    return LocalAgent("--no-lock", "--policy", str(policy_file),
                      "--nvme-dir", str(nvme_dir or tmp_path / "nvme"), "--nvme", "64Mi",
                      workdir=tmp_path, dram=dram)


def chunk_file(nvme_dir: Path, key: bytes) -> Path:
    """Where G3 keeps a chunk: one file per key, under the first two hex digits."""
    h = key.hex()
    return nvme_dir / h[:2] / f"{h}.kvc"


def fill(c: KVPoolClient, n: int, size: int = 256 * KiB) -> list[bytes]:
    keys = [os.urandom(16) for _ in range(n)]
    for k in keys:
        assert c.put(k, data_for(k, size))
    return keys


def settle(c: KVPoolClient) -> None:
    """Wait for demotions in flight to land and dropped files to go (worker threads)."""
    def settled() -> bool:
        nvme = c.stats()["tiers"]["nvme"]
        return bool(nvme["inflight"] == 0 and nvme["removing"] == 0)
    wait_until(settled, what="demotions to land")


def tier_of(c: KVPoolClient, key: bytes) -> str | None:
    tiers = c.lookup_tiers([key])
    return tiers[0] if tiers else None


def in_nvme(c: KVPoolClient, nvme_dir: Path, keys: list[bytes]) -> list[bytes]:
    return [k for k in keys if chunk_file(nvme_dir, k).exists()]


@contextlib.contextmanager
def overflowed(tmp_path: Path, mode: str) -> Iterator[tuple[LocalAgent, KVPoolClient,
                                                           KVPoolClient, list[bytes]]]:
    """An agent whose DRAM overflowed into NVMe: the agent, the client that wrote, a reader
    in `mode`, and the keys of the chunks in NVMe (their files there)."""
    with nvme_agent(tmp_path) as agent, KVPoolClient(agent.socket_path) as writer, \
            KVPoolClient(agent.socket_path, mode=mode) as c:  # type: ignore[arg-type]
        keys = fill(writer, 24)
        settle(writer)
        yield agent, writer, c, in_nvme(writer, tmp_path / "nvme", keys)


def test_writes_beyond_dram_are_demoted_to_nvme_and_looked_up_there(tmp_path: Path) -> None:
    with nvme_agent(tmp_path) as agent, KVPoolClient(agent.socket_path) as c:
        keys = fill(c, 24)  # 6 MiB into a 4 MiB arena
        settle(c)
        tiers = {k: tier_of(c, k) for k in keys}
        demoted = [k for k, t in tiers.items() if t == "nvme"]
        assert demoted, "nothing was demoted"
        assert set(tiers.values()) == {"dram", "nvme"}  # every chunk is in one of them
        stats = c.stats()["tiers"]
        assert stats["nvme"]["chunks"] == len(demoted)
        assert stats["dram"]["chunks"] + stats["nvme"]["chunks"] == len(keys)  # exclusive
        assert scrape(agent)[DEMOTED] == len(demoted)
        assert sorted(in_nvme(c, tmp_path / "nvme", keys)) == sorted(demoted)
        # One prompt across both tiers: LOOKUP names each chunk's tier, up to the first miss.
        in_dram = [k for k, t in tiers.items() if t == "dram"]
        prompt = [demoted[0], in_dram[0], demoted[1], os.urandom(16), in_dram[1]]
        assert c.lookup_tiers(prompt) == ["nvme", "dram", "nvme"]


@pytest.mark.parametrize("mode", ["zero_copy", "inline"])
def test_reading_an_nvme_chunk_returns_its_bytes_and_moves_it_up(tmp_path: Path,
                                                                 mode: str) -> None:
    nvme_dir = tmp_path / "nvme"
    with overflowed(tmp_path, mode) as (agent, _, c, on_nvme):
        k = on_nvme[0]
        assert c.get(k, verify=True) == data_for(k, 256 * KiB)
        assert scrape(agent)[PROMOTED] == 1
        # Tiers are exclusive: the promoted chunk is in DRAM and its file goes.
        assert tier_of(c, k) == "dram"
        wait_until(lambda: not chunk_file(nvme_dir, k).exists(), what="the promoted file to go")
        assert c.get(k) == data_for(k, 256 * KiB)


def test_a_lookup_that_reaches_nvme_prefetches_the_next_chunks(tmp_path: Path) -> None:
    nvme_dir = tmp_path / "nvme"
    policy = "prefetch: {enabled: true, lookaheadChunks: 2}\n"
    with nvme_agent(tmp_path, policy) as agent, KVPoolClient(agent.socket_path) as c:
        keys = fill(c, 24)
        settle(c)
        prefix = in_nvme(c, nvme_dir, keys)[:4]  # a prompt whose chunks all went to NVMe
        assert len(prefix) == 4
        assert c.lookup_tiers(prefix) == ["nvme"] * 4
        wait_until(lambda: scrape(agent)[PREFETCHED] == 2, what="two prefetches")
        wait_until(lambda: not any(chunk_file(nvme_dir, k).exists() for k in prefix[:2]),
                   what="the prefetched files to go")
        assert all(chunk_file(nvme_dir, k).exists() for k in prefix[2:])
        tiers = c.lookup_tiers(prefix)
        assert tiers[:2] == ["dram", "dram"]
        # That LOOKUP prefetches the other two, each in its own task: either may be up.
        assert len(tiers) == 4 and set(tiers[2:]) <= {"nvme", "dram"}
        assert all(c.get(k) == data_for(k, 256 * KiB) for k in prefix)


def truncate_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


@pytest.mark.parametrize("damage", [flip_last_byte, truncate_to_half],
                         ids=["flipped-byte", "truncated"])
@pytest.mark.parametrize("mode", ["zero_copy", "inline"])
def test_a_damaged_nvme_chunk_is_a_counted_quarantined_miss(tmp_path: Path, mode: str,
                                                            damage: object) -> None:
    nvme_dir = tmp_path / "nvme"
    with overflowed(tmp_path, mode) as (agent, _, c, on_nvme):
        bad, good = on_nvme[:2]
        path = chunk_file(nvme_dir, bad)
        damage(path)  # type: ignore[operator]
        assert c.get(bad) is None  # never the damaged bytes
        assert scrape(agent)[BAD_NVME] == 1
        assert not path.exists() and (nvme_dir / "quarantine" / path.name).exists()
        assert c.lookup([bad]) == 0  # gone from the index, not only from this read
        assert c.get(bad) is None and scrape(agent)[BAD_NVME] == 1
        assert c.get(good) == data_for(good, 256 * KiB)  # its neighbours are unaffected


@pytest.mark.parametrize("mode", ["zero_copy", "inline"])
def test_an_unreadable_nvme_chunk_leaves_no_stuck_index_entry(tmp_path: Path, mode: str) -> None:
    nvme_dir = tmp_path / "nvme"
    with overflowed(tmp_path, mode) as (agent, writer, c, on_nvme):
        bad, good = on_nvme[:2]
        chunks = writer.stats()["tiers"]["nvme"]["chunks"]
        path = chunk_file(nvme_dir, bad)
        path.unlink()
        path.mkdir()  # a read of the chunk's file now fails with an OSError (EISDIR)
        assert c.get(bad) is None
        assert scrape(agent)[series("kvpool_tier_errors_total", kind="read", tier="nvme")] == 1
        # Out of the index: LOOKUP misses, the tier counts one chunk less, and a fresh PUT
        # of the key is stored (it used to be refused as a duplicate, for good).
        assert c.lookup([bad]) == 0
        assert writer.stats()["tiers"]["nvme"]["chunks"] == chunks - 1
        fresh = data_for(bad[::-1], 256 * KiB)
        assert c.put(bad, fresh)
        assert c.get(bad, verify=True) == fresh
        assert c.get(good) == data_for(good, 256 * KiB)


def test_nvme_directories_removed_while_running_are_made_again_and_their_chunks_forgotten(
        tmp_path: Path) -> None:
    nvme_dir = tmp_path / "nvme"
    with nvme_agent(tmp_path) as agent, KVPoolClient(agent.socket_path) as c:
        keys = fill(c, 24)
        settle(c)
        old = in_nvme(c, nvme_dir, keys)
        assert old
        for sub in nvme_dir.iterdir():
            if sub.name != "quarantine":
                shutil.rmtree(sub)

        # The chunks went with their directories: forgotten, not counted, not looked up.
        def forgotten() -> bool:
            nvme = c.stats()["tiers"]["nvme"]
            return bool(nvme["chunks"] == 0 and nvme["used_bytes"] == 0)
        wait_until(forgotten, what="the vanished chunks to be forgotten")
        assert c.lookup([old[0]]) == 0

        # New demotions make the directories again instead of being dropped.
        new = fill(c, 24)
        settle(c)
        tiers = [tier_of(c, k) for k in new]
        assert "nvme" in tiers and set(tiers) <= {"dram", "nvme"}, tiers
        on_disk = in_nvme(c, nvme_dir, new)
        assert sorted(on_disk) == sorted(k for k, t in zip(new, tiers, strict=True)
                                         if t == "nvme")
        # The index holds exactly the files there are (the new chunks' and the first
        # ones' that were still in DRAM when the directories went).
        assert c.stats()["tiers"]["nvme"]["chunks"] == len(list(nvme_dir.glob("??/*.kvc")))
        assert scrape(agent)[NVME_HEALTHY] == 1
        assert all(c.get(k, verify=True) == data_for(k, 256 * KiB) for k in new)


def test_chunks_with_large_headers_and_long_tenant_names_survive_a_restart(
        tmp_path: Path) -> None:
    nvme_dir = tmp_path / "nvme"
    config = tmp_path / "agent.yaml"
    config.write_text("maxMetaBytes: 16384\n")
    policy = tmp_path / "policy.yaml"
    policy.write_text(NO_PREFETCH)
    agent = LocalAgent("--no-lock", "--config", str(config), "--policy", str(policy),
                       "--nvme-dir", str(nvme_dir), "--nvme", "64Mi",
                       workdir=tmp_path, dram="4Mi")
    tenant = "t" * 253  # the longest name HELLO accepts
    big = {os.urandom(16): (b"m" * 8000, ""), os.urandom(16): (b"n" * 4096, tenant)}
    with agent:
        for key, (meta, name) in big.items():
            with KVPoolClient(agent.socket_path, tenant=name) as c:
                assert c.put(key, data_for(key, 256 * KiB), meta=meta)
        with KVPoolClient(agent.socket_path) as c:
            fill(c, 24)  # pushes the first chunks down into NVMe
            settle(c)
            assert sorted(in_nvme(c, nvme_dir, list(big))) == sorted(big)
        agent.stop(remove_arena=False)
        agent.start()
        # The start-up scan read their whole headers: indexed, not quarantined.
        assert not list((nvme_dir / "quarantine").iterdir())
        for key, (meta, name) in big.items():
            with KVPoolClient(agent.socket_path, tenant=name) as c:
                assert c.lookup_tiers([key]) == ["nvme"]
                assert c.get_with_meta(key, verify=True) == (data_for(key, 256 * KiB), meta)


def test_quarantine_is_cleaned_to_its_budget_and_taken_from_the_nvme_size(
        tmp_path: Path) -> None:
    nvme_dir = tmp_path / "nvme"
    quarantine = nvme_dir / "quarantine"
    quarantine.mkdir(parents=True)
    for i in range(8):  # 8 MiB of old bad files; the budget of a 64 MiB tier is 4 MiB
        bad = quarantine / f"bad-{i}.kvc"
        bad.write_bytes(b"x" * MiB)
        os.utime(bad, (1_000_000 + i, 1_000_000 + i))

    def quarantined() -> int:
        return sum(f.stat().st_size for f in quarantine.iterdir())

    with nvme_agent(tmp_path) as agent, KVPoolClient(agent.socket_path) as c:
        assert quarantined() <= 4 * MiB
        assert (quarantine / "bad-7.kvc").exists() and not (quarantine / "bad-0.kvc").exists()
        assert c.stats()["tiers"]["nvme"]["capacity_bytes"] == 64 * MiB - quarantined()

        keys = fill(c, 24)
        settle(c)
        bad = in_nvme(c, nvme_dir, keys)[0]
        flip_last_byte(chunk_file(nvme_dir, bad))
        assert c.get(bad) is None
        assert (quarantine / chunk_file(nvme_dir, bad).name).exists()
        assert quarantined() <= 4 * MiB
        assert c.stats()["tiers"]["nvme"]["capacity_bytes"] == 64 * MiB - quarantined()


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A real, small file system. Tests run as root (here and in CI); if mounting is not
    permitted this fails loudly rather than skip a test of a real full disk."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.fail(f"this test needs a real {size} tmpfs (run it as root): mount said "
                    f"{mounted.stderr.strip() or mounted.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True, capture_output=True)


def fill_filesystem(path: Path) -> None:
    """Write `path` until the file system says it is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    block = b"\0" * (4 * KiB)
    try:
        while True:
            os.write(fd, block)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


def cli_stats(agent: LocalAgent) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-m", "kvpool.agent", "stats", "--socket",
                          str(agent.socket_path), "--json"],
                         check=True, capture_output=True, text=True, timeout=60)
    stats: dict[str, object] = json.loads(out.stdout)
    return stats


def test_a_full_nvme_filesystem_drops_demotions_and_recovers_when_space_returns(
        tmp_path: Path) -> None:
    size = 64 * KiB
    with small_tmpfs(tmp_path / "nvme", "2m") as nvme_dir, \
            nvme_agent(tmp_path, dram="2Mi", nvme_dir=nvme_dir) as agent, \
            KVPoolClient(agent.socket_path) as c:
        before = fill(c, 40, size)
        settle(c)
        landed = scrape(agent)[DEMOTED]
        assert landed > 0 and scrape(agent)[NVME_HEALTHY] == 1

        filler = nvme_dir / "filler"  # something else took the disk
        fill_filesystem(filler)
        keys = fill(c, 40, size)
        settle(c)
        m = scrape(agent)
        assert m[NVME_FULL] > 0, "failed demotions were not counted as kind=full"
        assert m[NVME_HEALTHY] == 0
        assert m[DEMOTED] == landed  # nothing landed, and nothing pretended to
        nvme_stats = cli_stats(agent)["tiers"]["nvme"]  # type: ignore[index]
        assert nvme_stats["healthy"] is False
        assert "full" in nvme_stats["reason"]
        # DRAM keeps serving, reads and writes, and the agent stays up.
        in_dram = [k for k in keys if tier_of(c, k) == "dram"]
        assert in_dram and all(c.get(k) == data_for(k, size) for k in in_dram)
        # Each new chunk is read back before the next is written: the default order keeps a
        # never-read chunk in a probation queue that the next put may evict (a scan).
        for k in (os.urandom(16) for _ in range(4)):
            assert c.put(k, data_for(k, size)) and c.get(k) == data_for(k, size)
        assert agent.proc is not None and agent.proc.poll() is None
        with urllib.request.urlopen(f"{agent.metrics_url}/healthz", timeout=10) as r:
            assert r.status == 200
        # Chunks already on the full disk are still read (last: the read frees their file).
        on_disk = in_nvme(c, nvme_dir, before)
        assert on_disk and c.get(on_disk[0]) == data_for(on_disk[0], size)

        filler.unlink()  # space returns (for a few chunks more than this writes)
        fill(c, 6, size)
        settle(c)
        m = scrape(agent)
        assert m[DEMOTED] > landed, "demotions did not land again"
        assert m[NVME_HEALTHY] == 1
        assert cli_stats(agent)["tiers"]["nvme"]["healthy"] is True  # type: ignore[index]
        assert agent.proc.poll() is None


def test_nvme_index_is_rebuilt_at_restart_and_serves_the_chunks_written_before(
        tmp_path: Path) -> None:
    nvme_dir = tmp_path / "nvme"
    agent = nvme_agent(tmp_path).start()
    try:
        with KVPoolClient(agent.socket_path) as c:
            keys = fill(c, 24)
            settle(c)
            on_disk = in_nvme(c, nvme_dir, keys)
            assert on_disk
        agent.stop()  # and the arena goes with it: only G3 remains
        # What a crash mid-write leaves behind, and a file damaged while the agent was down.
        leftover = chunk_file(nvme_dir, on_disk[0]).with_name("leftover.kvc.tmp-1-2")
        leftover.write_bytes(b"half a chunk")
        damaged = chunk_file(nvme_dir, on_disk[1])
        truncate_to_half(damaged)
        agent.start()
        with KVPoolClient(agent.socket_path) as c:
            intact = [k for k in on_disk if k != on_disk[1]]
            stats = c.stats()["tiers"]
            assert stats["nvme"]["chunks"] == len(intact)
            assert stats["dram"]["chunks"] == 0
            assert all(tier_of(c, k) == "nvme" for k in intact)
            assert all(c.get(k, verify=True) == data_for(k, 256 * KiB) for k in intact)
            assert c.get(on_disk[1]) is None
            assert (nvme_dir / "quarantine" / damaged.name).exists()
            assert not leftover.exists()
            assert all(c.get(k) is None for k in keys if k not in on_disk)  # DRAM-only: gone
    finally:
        agent.stop()


def test_bursts_of_demotions_and_promotions_leave_the_index_and_the_disk_alike(
        tmp_path: Path) -> None:
    """Demotions are written and promoted chunks' files removed a batch at a time: after
    bursts of both, the files on disk are exactly the chunks LOOKUP finds in NVMe, the
    tier's accounting adds up to them, and every chunk reads back right."""
    nvme_dir = tmp_path / "nvme"
    size = 64 * KiB
    with nvme_agent(tmp_path, dram="2Mi") as agent, KVPoolClient(agent.socket_path) as c:
        keys = [os.urandom(16) for _ in range(120)]  # 7.5 MiB through a 2 MiB arena
        for start in range(0, len(keys), 12):  # write leases on at most half the arena
            batch = keys[start : start + 12]
            assert c.put_many(batch, [data_for(k, size) for k in batch]) == [True] * 12
        settle(c)
        # Read back a burst of NVMe chunks in one batch: each promotion removes a file and
        # demotes a DRAM victim.
        below = [k for k in keys if tier_of(c, k) == "nvme"][:12]
        assert len(below) == 12
        bufs = [bytearray(size) for _ in below]
        assert c.get_many_into(below, lambda i, n, meta: bufs[i]) == [size] * len(below)
        assert all(bytes(b) == data_for(k, size) for k, b in zip(below, bufs, strict=True))
        settle(c)
        tiers = {k: tier_of(c, k) for k in keys}
        in_nvme_index = sorted(k for k, t in tiers.items() if t == "nvme")
        assert sorted(in_nvme(c, nvme_dir, keys)) == in_nvme_index
        files = [p for p in nvme_dir.glob("*/*") if p.parent.name != "quarantine"]
        assert len(files) == len(in_nvme_index)  # no stray or temporary file either
        nvme = c.stats()["tiers"]["nvme"]
        assert nvme["chunks"] == len(in_nvme_index)
        assert nvme["used_bytes"] == sum(p.stat().st_size for p in files)
        assert set(tiers.values()) == {"dram", "nvme"}  # nothing lost on the way
        assert scrape(agent)[DEMOTED] >= len(in_nvme_index)
        assert all(c.get(k) == data_for(k, size) for k in keys)



FILE = 16 * KiB
"""One chunk file (header and chunk) in whole tmpfs pages: a file system of exactly NVMe's
size then holds exactly NVMe's size of them, and going over it is ENOSPC, not rounding."""
ALWAYS_FULL = ("tiers: {dram: {eviction: lru},"
               " nvme: {eviction: lru, highWatermark: 1.0, lowWatermark: 0.99}}\n")
"""NVMe kept full: each demotion makes its own room by evicting the oldest file."""


def test_demotions_never_overrun_an_nvme_filesystem_of_exactly_its_size(tmp_path: Path) -> None:
    """Room made in NVMe by evicting a chunk is free on disk only once a worker thread has
    removed its file. Bursts of demotions through a 1 MiB DRAM tier into a 1 MiB NVMe tier
    on a file system of exactly 1 MiB: no demotion finds the disk full, so no acknowledged
    chunk that fits is lost. Before, a demotion's file was written while the files it
    replaced were still there: ENOSPC, and the acknowledged chunk was dropped."""
    size, capacity = FILE - HEADER_BYTES, 1 * MiB  # the default tenant's header: no name
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(NO_PREFETCH + ALWAYS_FULL)
    with small_tmpfs(tmp_path / "nvme", str(capacity)) as nvme_dir, \
            LocalAgent("--no-lock", "--policy", str(policy_file), "--nvme-dir", str(nvme_dir),
                       "--nvme", str(capacity), workdir=tmp_path, dram="1Mi") as agent, \
            KVPoolClient(agent.socket_path, mode="zero_copy") as c:
        keys: list[bytes] = []
        for _ in range(40):  # 10 MiB, in bursts of 16 chunks
            burst = [os.urandom(16) for _ in range(16)]
            assert c.put_many(burst, [data_for(k, size) for k in burst]) == [True] * 16
            keys += burst
        settle(c)
        nvme = c.stats()["tiers"]["nvme"]
        assert nvme["used_bytes"] == nvme["chunks"] * FILE  # whole pages, as sized
        errors = {s: n for s, n in scrape(agent).items()
                  if s.startswith("kvpool_tier_errors_total") and 'tier="nvme"' in s and n}
        assert not errors, f"NVMe errors {errors}; the log ends:\n{agent.log()[-1500:]}"
        # LRU in both tiers: NVMe holds the newest demotions, down to its low watermark at
        # least (and DRAM newer chunks still).
        newest = keys[-int(capacity * 0.99) // FILE:]
        lost = [k for k in newest if tier_of(c, k) is None]
        assert not lost, f"{len(lost)} of the newest {len(newest)} acknowledged chunks lost"
        assert all(c.get(k, verify=True) == data_for(k, size) for k in newest)


def test_a_read_right_behind_the_lookup_that_prefetches_its_chunk_is_never_a_miss(
        tmp_path: Path) -> None:
    """The LOOKUP's prefetches and the GETs of the same chunks are pipelined: a GET may
    start its NVMe read while the prefetch moves the chunk up and its file goes. Before
    the fix such a GET answered NOT_FOUND for a stored chunk (7 in 180 here)."""
    nvme_dir = tmp_path / "nvme"
    policy = "prefetch: {enabled: true, lookaheadChunks: 4}\n"
    with nvme_agent(tmp_path, policy) as agent, KVPoolClient(agent.socket_path) as c:
        raw = RawConn(agent.socket_path)
        try:
            for _ in range(15):
                keys = fill(c, 24)
                settle(c)
                prefix = in_nvme(c, nvme_dir, keys)[:6]
                raw.send(p.encode(p.Lookup(1, prefix)) + b"".join(
                    p.encode(p.Get(2 + i, k)) for i, k in enumerate(prefix)))
                assert isinstance(raw.reply(), p.LookupReply)
                for k in prefix:
                    reply = raw.reply()
                    assert isinstance(reply, p.GetReply), f"{k.hex()}: {reply}"
                    assert reply.data == data_for(k, 256 * KiB)
        finally:
            raw.close()
