"""The DELETEs waiting for nodes away (`peers.awaynodes`): what a node's new link takes is
what waited for its old links and what was made while it was away, oldest first, bounded;
a node away too long leaves with its DELETEs; the count of waiting keys stays exact."""

from __future__ import annotations

from collections import OrderedDict

from kvpool.agent.peers.awaynodes import NODE_KEEP, AwayNodes
from kvpool.agent.peers.deletelog import Item, Waiting


def _item(i: int) -> Item:
    return "", i.to_bytes(16, "big")


def _waiting(*ids: int, until: float = 0.0) -> Waiting:
    return OrderedDict((_item(i), until) for i in ids)


def test_a_node_takes_what_waited_for_each_of_its_addresses_and_what_was_made_meanwhile(
        ) -> None:
    away = AwayNodes(bound=100)
    assert away.park("n1", "a:1", _waiting(1, 2), now=0.0) == []
    assert away.park("n2", "b:1", _waiting(2), now=0.0) == []
    assert away.park("n1", "a:2", _waiting(3, until=50.0), now=10.0) == []  # moved again
    names, dropped = away.add(_item(4))  # made while both are away
    assert sorted(names) == ["a:2", "b:1"] and dropped == []  # each node's latest name
    assert away.items == {_item(1): 1, _item(2): 2, _item(3): 1, _item(4): 2}
    assert sorted(away.entries()) == sorted([
        ("a:1", _item(1), 0.0), ("a:1", _item(2), 0.0), ("a:2", _item(3), 50.0),
        ("a:2", _item(4), 0.0), ("b:1", _item(2), 0.0), ("b:1", _item(4), 0.0)])
    assert away.take("n1") == {"a:1": _waiting(1, 2),
                               "a:2": OrderedDict([(_item(3), 50.0), (_item(4), 0.0)])}
    assert away.take("n1") == {}  # back: away no more
    assert away.items == {_item(2): 1, _item(4): 1}
    assert list(away.nodes) == ["n2"]


def test_a_node_away_past_its_time_leaves_with_its_deletes_and_the_bound_drops_the_oldest(
        ) -> None:
    away = AwayNodes(bound=3)
    assert away.park("n1", "a:1", _waiting(1, 2), now=0.0) == []
    assert away.park("n1", "a:2", _waiting(3), now=5.0) == []
    assert away.add(_item(4)) == (["a:2"], [("a:1", _item(1))])  # the oldest goes
    assert away.park("n2", "b:1", OrderedDict(), now=NODE_KEEP) == []  # nothing waited yet
    assert away.add(_item(5)) == (["a:2", "b:1"], [("a:1", _item(2))])
    assert away.expire(NODE_KEEP + 4.0) == {}  # n1 went last at 5
    assert away.expire(NODE_KEEP + 5.0) == {"n1": {"a:2": _waiting(3, 4, 5)}}
    assert list(away.nodes) == ["n2"] and away.items == {_item(5): 1}
