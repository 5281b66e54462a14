"""The flat structures of a tier's index (`keytable.KeyTable`, `eviction.GhostList`) answer
exactly as the dicts they replace, under any sequence of operations."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.agent.constants import KEY_BYTES
from kvpool.agent.eviction import GhostList
from kvpool.agent.keytable import KeyTable

# Few distinct keys, many operations: keys come and go and come back, tables grow and
# fill with tombstones and are rebuilt.
_keys = st.integers(0, 40).map(lambda i: i.to_bytes(KEY_BYTES, "little"))
_ops = st.lists(st.tuples(st.sampled_from(["add", "remove", "release"]), _keys),
                max_size=3000)


@settings(max_examples=60, deadline=None)
@given(_ops)
def test_key_table_finds_what_a_dict_would(ops: list[tuple[str, bytes]]) -> None:
    table = KeyTable()
    model: dict[bytes, int] = {}
    removed: list[int] = []  # slots out of the table, not yet released
    for op, key in ops:
        if op == "add" and key not in model:
            slot = table.add(key)
            assert slot not in model.values() and slot not in removed, "a taken slot reused"
            model[key] = slot
        elif op == "remove" and key in model:
            assert table.remove(key) == model[key]
            removed.append(model.pop(key))
            assert table.key_at(removed[-1]) == key  # still readable until released
        elif op == "release" and removed:
            table.release(removed.pop(0))
        for k in {key, *model}:
            assert table.find(k) == model.get(k, -1)
        assert len(table) == len(model)
    assert sorted(table.live_slots()) == sorted(model.values())
    assert all(table.key_at(s) == k for k, s in model.items())


def test_key_table_grows_past_its_first_table() -> None:
    table = KeyTable()
    keys = [i.to_bytes(KEY_BYTES, "big") for i in range(5000)]
    slots = [table.add(k) for k in keys]
    assert slots == list(range(5000)) and table.slots == 5000
    assert [table.find(k) for k in keys] == slots


_ghost_ops = st.lists(st.tuples(st.sampled_from(["add", "discard", "pop_oldest"]),
                                st.integers(0, 30).map(lambda i: b"k%d" % i)), max_size=3000)


@settings(max_examples=60, deadline=None)
@given(_ghost_ops)
def test_ghost_list_remembers_and_forgets_as_an_ordered_dict(
        ops: list[tuple[str, bytes]]) -> None:
    ghost = GhostList()
    model: OrderedDict[bytes, None] = OrderedDict()
    for op, key in ops:
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
        assert all((k in ghost) == (k in model) for k in (key, *model))
    while model:  # the oldest go first, in order
        oldest = next(iter(model))
        ghost.pop_oldest()
        model.popitem(last=False)
        assert oldest not in ghost and all(k in ghost for k in model)
