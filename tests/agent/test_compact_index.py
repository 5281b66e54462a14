"""The flat structures of a tier's index (`keytable.KeyTable`, `eviction.GhostList`) and of
the store's memory of recent LOOKUPs (`store.recent.RecentLookups`) answer exactly as the
dicts they replace, under any sequence of operations."""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.agent import probekernel
from kvpool.agent.constants import KEY_BYTES
from kvpool.agent.eviction import GhostList
from kvpool.agent.keytable import KeyTable, homes
from kvpool.agent.store.recent import RecentLookups
from kvpool.agent.tiers.facts import FactRows, hit_run

# Long random runs over up to 2,000 keys: keys come and go and come back, and the tables
# grow past their first 1,024 cells and are rebuilt (checked: most runs rebuild), which
# short generated sequences of operations never reached.
_runs = st.tuples(st.integers(0, 2**32), st.integers(2, 2000))
_OPS = 6000


@settings(max_examples=12, deadline=None)
@given(_runs)
def test_key_table_finds_what_a_dict_would(run: tuple[int, int]) -> None:
    seed, n_keys = run
    rnd = random.Random(seed)
    table = KeyTable()
    model: dict[bytes, int] = {}
    removed: list[int] = []  # slots out of the table, not yet released
    for i in range(_OPS):
        op = rnd.choice(["add", "add", "remove", "release"])
        key = rnd.randrange(n_keys).to_bytes(KEY_BYTES, "little")
        if op == "add" and key not in model:
            slot = table.add(key)
            assert slot not in model.values() and slot not in removed, "a taken slot reused"
            model[key] = slot
        elif op == "remove" and key in model:
            assert table.remove(key) == model[key]
            removed.append(model.pop(key))
            assert table.key_at(removed[-1]) == key  # still readable until released
        elif op == "release" and removed:
            table.release(removed.pop(rnd.randrange(len(removed))))
        assert table.find(key) == model.get(key, -1)
        assert len(table) == len(model)
        if i % 500 == 0:
            assert all(table.find(k) == s for k, s in model.items())
    assert sorted(table.live_slots()) == sorted(model.values())
    assert all(table.key_at(s) == k and table.find(k) == s for k, s in model.items())


def test_key_table_grows_past_its_first_table() -> None:
    table = KeyTable()
    keys = [i.to_bytes(KEY_BYTES, "big") for i in range(5000)]
    slots = [table.add(k) for k in keys]
    assert slots == list(range(5000)) and table.slots == 5000
    assert [table.find(k) for k in keys] == slots


def test_a_compiled_rebuild_places_every_key_where_pythons_does() -> None:
    # A rebuild (the table grown, or its tombstones cleared) in one compiled pass hashes
    # each key's bytes with CPython's own function: `find` (Python's `hash()`) and
    # `find_many` must still find every key, and each key lands in the cell the walk in
    # Python gives it.
    assert probekernel.kernels() is not None
    rnd = random.Random(20)
    tables = KeyTable(), KeyTable()
    keys = [rnd.randbytes(KEY_BYTES) for _ in range(20_000)]
    for t in tables:
        for k in keys:
            t.add(k)  # grown through five rebuilds (compiled: the loops are ready)
        for k in keys[::3]:
            t.release(t.remove(k))
    compiled, python = tables
    compiled._rebuild(compiled.live + 1, compiled=True)
    python._rebuild(python.live + 1, compiled=False)
    assert compiled.cells == python.cells and len(compiled.cells) > 1 << 14
    live = [k for i, k in enumerate(keys) if i % 3]
    assert all(compiled.find(k) == python.find(k) >= 0 for k in live)
    assert all(compiled.find(k) == -1 for k in keys[::3])
    slots, found = compiled.find_many(live[:128], b"".join(live[:128]), homes(live[:128]))
    assert found == b"\x01" * 128 and list(slots) == [python.find(k) for k in live[:128]]


@settings(max_examples=12, deadline=None)
@given(_runs)
def test_ghost_list_remembers_and_forgets_as_an_ordered_dict(run: tuple[int, int]) -> None:
    seed, n_keys = run
    rnd = random.Random(seed)
    ghost = GhostList()
    model: OrderedDict[bytes, None] = OrderedDict()
    for i in range(_OPS):
        op = rnd.choice(["add", "add", "discard", "pop_oldest"])
        key = b"k%d" % rnd.randrange(n_keys)
        if op == "add":
            ghost.add(key)
            model[key] = None  # a key remembered already keeps its place
        elif op == "discard":
            ghost.discard(key)
            model.pop(key, None)
        elif model:
            ghost.pop_oldest()
            model.popitem(last=False)
        assert len(ghost) == len(model)
        assert (key in ghost) == (key in model)
        if i % 500 == 0:
            assert all(k in ghost for k in model)
    while model:  # the oldest go first, in order
        oldest = next(iter(model))
        ghost.pop_oldest()
        model.popitem(last=False)
        assert oldest not in ghost and all(k in ghost for k in model)


@settings(max_examples=8, deadline=None)
@given(_runs)
def test_key_table_finds_many_keys_at_once_as_it_finds_each(run: tuple[int, int]) -> None:
    # LOOKUP's probe of 128 keys in one call (the compiled loop, and the Python walk it
    # falls back to) against `find`, at every stage of a random run: tombstones, reused
    # slots, rebuilt tables, keys asked twice, keys never added.
    assert probekernel.kernels() is not None  # llvmlite is the agent's dependency
    seed, n_keys = run
    rnd = random.Random(seed)
    table = KeyTable()
    removed: list[int] = []
    for i in range(_OPS):
        key = rnd.randrange(n_keys).to_bytes(KEY_BYTES, "little")
        op = rnd.choice(["add", "add", "remove", "release"])
        if op == "add" and table.find(key) < 0:
            table.add(key)
        elif op == "remove" and table.find(key) >= 0:
            removed.append(table.remove(key))
        elif op == "release" and removed:
            table.release(removed.pop(rnd.randrange(len(removed))))
        if i % 300 == 0:
            keys = [rnd.randrange(2 * n_keys).to_bytes(KEY_BYTES, "little")
                    for _ in range(rnd.randrange(129))]
            slots = [table.find(k) for k in keys]
            for compiled in (True, False):
                got, found = table.find_many(keys, b"".join(keys), homes(keys), compiled)
                assert list(got) == slots
                assert found == bytes(s >= 0 for s in slots)


def test_the_compiled_loop_joins_and_hashes_keys_as_python_does() -> None:
    # What LOOKUP's probes start from, taken by calling CPython's own C API: the same
    # bytes and the same hash() as `b"".join` and `homes`, and a key of another length is
    # found (LOOKUP then says which, as before).
    kernels = probekernel.kernels()
    assert kernels is not None
    rnd = random.Random(7)
    for n in (0, 1, 128, 8192):
        keys = [rnd.randbytes(KEY_BYTES) for _ in range(n)]
        assert kernels.prepare(keys) == (b"".join(keys), homes(keys))
    keys = [rnd.randbytes(KEY_BYTES) for _ in range(5)]
    for bad in (b"", b"x" * (KEY_BYTES - 1), b"x" * (KEY_BYTES + 1)):
        assert kernels.prepare([*keys, bad, *keys]) is None


def test_a_lookups_dram_hits_update_their_facts_at_once_as_one_by_one() -> None:
    # LOOKUP's leading DRAM keys, their facts updated in one compiled call: each slot one
    # more hit, the LOOKUP's seq, its depth (a key asked twice: its deeper one), the time.
    assert probekernel.kernels() is not None
    rnd = random.Random(11)
    rows = [FactRows(), FactRows()]
    for r in rows:
        for _ in range(300):
            r.add_row()
    for seq in range(1, 40):
        slots = array("q", (rnd.randrange(300) for _ in range(rnd.randrange(129))))
        n = rnd.randrange(len(slots) + 1)
        now = rnd.random() * 1e9
        for r, compiled in zip(rows, (True, False), strict=True):
            hit_run(r, slots, n, seq, now, compiled)
        assert [list(getattr(rows[0], c)) for c in FactRows.__slots__] == \
            [list(getattr(rows[1], c)) for c in FactRows.__slots__]
    assert sum(rows[0].hits) > 0


def test_key_table_refuses_keys_and_hashes_that_do_not_match() -> None:
    table = KeyTable()
    table.add(bytes(KEY_BYTES))
    keys = [bytes(KEY_BYTES), b"\1" * KEY_BYTES]
    assert probekernel.kernels() is not None
    with pytest.raises(ValueError):
        table.find_many(keys, b"".join(keys)[:-1], homes(keys))
    with pytest.raises(ValueError):
        table.find_many(keys, b"".join(keys), homes(keys[:1]))


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**32), st.integers(2, 600))
def test_recent_lookups_remember_each_keys_last_place_as_an_ordered_dict(
        seed: int, n_keys: int) -> None:
    # The store's model before: an OrderedDict of key -> (seq, depth, last), each LOOKUP's
    # keys moved to its end, the oldest dropped past its size. The generations remember
    # every key of the last half of that size (less one LOOKUP's keys) exactly as it did,
    # and never more keys than the size.
    rnd = random.Random(seed)
    size, most = 256, 40
    recent = RecentLookups(size)
    model: OrderedDict[bytes, tuple[int, int, bool]] = OrderedDict()
    for seq in range(1, 300):
        keys = [rnd.randrange(n_keys).to_bytes(KEY_BYTES, "little")
                for _ in range(rnd.randrange(1, most + 1))]
        recent.told(seq, keys)
        for depth, k in enumerate(keys):
            model[k] = (seq, depth, depth == len(keys) - 1)
            model.move_to_end(k)
        while len(model) > size:
            model.popitem(last=False)
        assert len(recent) <= size
        if seq % 10 == 0:
            kept = list(model)[-(size // 2 - most):]
            assert all(recent.get(k) == model[k] for k in kept)
            # older ones: right, or forgotten
            assert all(recent.get(k) in (None, model[k]) for k in model)
    assert recent.get(b"\xff" * KEY_BYTES) is None


def test_recent_lookups_answer_every_read_of_a_large_lookup_and_of_the_ones_after_it() -> None:
    # A LOOKUP of 8,192 keys, some asked twice (a key's depth is its deeper place), read key
    # by key (each read after the first uses what the first made), with LOOKUPs told in
    # between: a key told again answers for its new LOOKUP, the others for the old one.
    rnd = random.Random(5)
    recent = RecentLookups(1 << 16)
    keys = [rnd.randbytes(KEY_BYTES) for _ in range(8192)]
    keys[100] = keys[7]  # asked twice: its place is 100
    recent.told(1, keys)
    assert recent.get(keys[7]) == (1, 100, False)
    assert recent.get(keys[0]) == (1, 0, False)
    assert recent.get(keys[-1]) == (1, 8191, True)
    later = [keys[5], rnd.randbytes(KEY_BYTES)]
    recent.told(2, later)
    assert recent.get(keys[5]) == (2, 0, False)
    assert recent.get(later[1]) == (2, 1, True)
    for depth, key in enumerate(keys):
        if key not in (keys[5], keys[7]):
            assert recent.get(key) == (1, depth, depth == 8191)
    assert recent.get(rnd.randbytes(KEY_BYTES)) is None
