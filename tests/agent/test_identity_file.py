"""The file that keeps the engines' identities of a space's chunks for a restart
(`kvpool.agent.events.remembered`), on a real file: what it gives back after appends,
compactions, a torn last record and a restart that holds fewer chunks."""

from __future__ import annotations

from pathlib import Path

from kvpool.agent.events import IdentityLog, identity
from kvpool.agent.events.identity import Identity
from kvpool.agent.events.remembered import COMPACT_FLOOR, read


def ident(i: int) -> Identity:
    made = identity([i * 10 + 1, (1 << 64) - i - 1], list(range(i, i + 32)), i or None, 16, "m")
    assert made is not None
    return made


def same(a: Identity, b: Identity) -> bool:
    return (a.hashes.tolist(), a.parent, a.tokens.tolist(), a.block_size, a.model) == (
        b.hashes.tolist(), b.parent, b.tokens.tolist(), b.block_size, b.model)


def test_the_file_gives_back_the_live_identities_through_compactions_a_torn_tail_and_a_restart(
        tmp_path: Path) -> None:
    path = tmp_path / ".kvpool-identities"
    log = IdentityLog(path)
    live: dict[bytes, Identity] = {}
    log.live, log.live_count = lambda: list(live.items()), lambda: len(live)
    assert log.load(set()) == {} and path.exists()
    for i in range(4 * COMPACT_FLOOR):
        key = i.to_bytes(16, "big")
        live[key] = ident(i)
        log.keep(key, live[key])
        if i % 4:  # most leave again: the file is compacted to what stays
            del live[key]
            log.forget(key)
        assert log.records <= 2 * len(live) + COMPACT_FLOOR + 1
    got = read(path)
    assert got.keys() == live.keys()
    assert all(same(got[k], v) for k, v in live.items())

    with open(path, "ab") as f:  # the agent killed in the middle of an append
        f.write(b"\x01\x40\x00\x00\x00\x12")
    assert read(path).keys() == live.keys()

    log.close()
    held = set(list(live)[:5])
    again = IdentityLog(path)
    kept = again.load(held)  # a restart: only what the tiers still hold
    assert kept.keys() == held and all(same(kept[k], live[k]) for k in held)
    assert read(path).keys() == held  # and the file rewritten to it, torn tail gone
    again.close()
