"""The flat structures of a tier's index (`keytable.KeyTable`, `eviction.GhostList`) answer
exactly as the dicts they replace, under any sequence of operations."""

from __future__ import annotations

import random
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.agent.constants import KEY_BYTES
from kvpool.agent.eviction import GhostList
from kvpool.agent.keytable import KeyTable

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
