"""The file of the peer DELETEs waiting for their peers (`peers.deletelog`): what is read
back is what waited, through rewrites; a torn or damaged tail is ignored (logged), never a
crash or a DELETE nobody made; a link records on it what it does with its DELETEs; and a
starting agent's peer network queues them again."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvpool.agent.config import Peers
from kvpool.agent.peers import awaynodes, deletelog, links
from kvpool.agent.peers.deletelog import DeleteLog, Item, read
from kvpool.agent.peers.links import PeerLink
from kvpool.agent.peers.metrics import PeerMetrics
from kvpool.agent.peers.network import PeerNetwork
from kvpool.bench.local import free_port

from .conftest import credentials
from .nodes import PEER_PORT

B, C = "10.0.0.2:9410", "10.0.0.3:9410"


def _item(i: int, tenant: str = "") -> Item:
    return tenant, i.to_bytes(16, "big")


def test_the_file_reads_back_what_waits_and_ignores_a_torn_or_damaged_tail(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state" / "peer-deletes"
    dlog, saved = DeleteLog.open(path)
    assert saved == {} and path.exists()
    dlog.wait(_item(1), [B, C])
    dlog.wait(_item(2, "t"), [B, C])
    dlog.gone(B, [_item(1)])
    dlog.wait_each(C, [_item(2, "t")], until=1234.5)  # refused by C
    dlog.wait(_item(3), [C])
    dlog.close()
    want = {B: {_item(2, "t"): 0.0}, C: {_item(1): 0.0, _item(2, "t"): 1234.5, _item(3): 0.0}}
    assert read(path) == want
    assert list(read(path)[C]) == [_item(1), _item(2, "t"), _item(3)]  # oldest first

    # A kill mid-append: every cut of the last record is ignored, logged, and what came
    # before it is read.
    dlog, _ = DeleteLog.open(path)  # (rewritten)
    whole = path.read_bytes()
    dlog.wait(_item(4), [B])
    dlog.close()
    grown = path.read_bytes()
    assert read(path)[B] == {_item(2, "t"): 0.0, _item(4): 0.0}
    caplog.set_level(logging.WARNING, "kvpool.agent.peers.deletelog")
    for cut in range(len(whole) + 1, len(grown)):
        path.write_bytes(grown[:cut])
        caplog.clear()
        assert read(path) == want
        assert "torn or damaged" in caplog.text

    # A start cuts the torn tail off, so what it appends after is read back.
    dlog, saved = DeleteLog.open(path)
    assert saved == want
    dlog.wait(_item(5), [B])
    dlog.close()
    assert read(path)[B] == {_item(2, "t"): 0.0, _item(5): 0.0}

    # A damaged byte inside a record: the records from there on are ignored, logged.
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    caplog.clear()
    assert read(path)[B] == {_item(2, "t"): 0.0}
    assert "torn or damaged" in caplog.text
    # Bytes that are no record at all.
    path.write_bytes(b"\xff" * 100)
    assert read(path) == {}


def test_the_file_is_rewritten_from_what_waits_and_stays_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deletelog, "COMPACT_FLOOR", 16)
    path = tmp_path / "peer-deletes"
    dlog, _ = DeleteLog.open(path)
    waiting: dict[str, dict[Item, float]] = {B: {}, C: {}}

    def live() -> Iterator[tuple[str, Item, float]]:
        for name, q in waiting.items():
            for item, until in q.items():
                yield name, item, until
    dlog.live = live
    for i in range(300):  # B answers each; C, unreachable, keeps every 30th
        item = _item(i)
        waiting[B][item] = waiting[C][item] = 0.0
        dlog.wait(item, [B, C])
        del waiting[B][item]
        dlog.gone(B, [item])
        if i % 30:
            del waiting[C][item]
            dlog.gone(C, [item])
    dlog.close()
    assert dlog.rewrites > 10
    assert read(path) == {C: waiting[C]}
    assert path.stat().st_size < 1000  # 10 waiting, not 900 records


def test_a_link_keeps_its_file_as_its_deletes_go_are_refused_and_dropped(
        tmp_path: Path, secret: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "peer-deletes"
    dlog, _ = DeleteLog.open(path)
    link = PeerLink(0, "192.0.2.1", PEER_PORT, credentials=credentials(secret),
                    agent_id=bytes(16), connections=1, directories={},
                    metrics=PeerMetrics(CollectorRegistry(), "p"))
    link.log = dlog
    name = link.name

    def queue(*items: Item) -> None:  # as the network does
        for item in items:
            link.queue_delete(*item)
            dlog.wait(item, [name])

    def on_file() -> dict[Item, float]:
        return dict(read(path).get(name, {}))

    queue(_item(1), _item(2), _item(3))
    batch = link.take_deletes()
    # Rewritten while the batch is on its way: it is still on file.
    dlog.live = lambda: ((name, item, 0.0) for item in (*link.taken, *link.deletes))
    dlog.rewrite(list(dlog.live()))
    assert on_file() == dict.fromkeys(batch, 0.0)
    # 1 deleted there, 2 refused, 3 not delivered.
    link.answered(batch, [_item(3)], [_item(2)], link.follows)
    assert not link.taken and list(link.refused) == [_item(2)]
    got = on_file()
    assert set(got) == {_item(2), _item(3)} and got[_item(3)] == 0.0
    assert time.time() + links.REFUSED_KEEP - 5 < got[_item(2)] <= time.time() + links.REFUSED_KEEP
    # The peer subscribes: the refused one waits until delivered again.
    link.followed()
    assert on_file() == {_item(3): 0.0, _item(2): 0.0}
    link.answered(link.take_deletes(), [], [], link.follows)
    assert on_file() == {}
    # A refused one past its time, and the oldest past the bound: dropped, off the file.
    queue(_item(4))
    link.hold_refused(link.take_deletes(), link.follows)
    link.expire_refused(time.monotonic() + links.REFUSED_KEEP)
    assert not link.refused and on_file() == {}
    monkeypatch.setattr(links, "MAX_PENDING_DELETES", 2)
    queue(_item(5), _item(6), _item(7))
    assert on_file() == {_item(6): 0.0, _item(7): 0.0}
    link.hold_refused(link.take_deletes(), link.follows)
    queue(_item(8))
    link.hold_refused(link.take_deletes(), link.follows)
    assert list(link.refused) == [_item(7), _item(8)] and set(on_file()) == set(link.refused)
    dlog.close()


def test_a_starting_network_queues_each_peers_deletes_again_and_drops_what_it_may_not_keep(
        tmp_path: Path, secret: Path) -> None:
    path = tmp_path / "peer-deletes"
    peer, unlisted = f"127.0.0.1:{free_port()}", "192.0.2.9:9410"
    later = time.time() + 300
    dlog, _ = DeleteLog.open(path)
    dlog.wait(_item(1), [peer, unlisted])
    dlog.wait_each(peer, [_item(2)], until=time.time() - 1)  # refused; its time ran out
    dlog.wait_each(peer, [_item(3)], until=later)  # refused; time left
    dlog.close()
    cfg = Peers.model_validate({"enabled": True, "port": free_port(), "address": "127.0.0.1",
                                "secretFile": str(secret), "addresses": [peer]})
    registry = CollectorRegistry()

    async def started() -> list[Item]:
        network = PeerNetwork(cfg, {}, registry, "p", deletes_file=path)
        await network.start()
        try:
            return list(network.links[("127.0.0.1", int(peer.rpartition(":")[2]))].deletes)
        finally:
            await network.close()

    def dropped(name: str) -> float:
        return registry.get_sample_value("kvpool_peer_deletes_total", {
            "pool": "p", "peer": name, "direction": "sent", "result": "dropped"}) or 0

    # The peer's are queued again, to go before its inventory; the refused one past its
    # time, and those of a peer the agent no longer has, are dropped (counted), on file too.
    assert asyncio.run(started()) == [_item(1), _item(3)]
    assert dropped(peer) == 1 and dropped(unlisted) == 1
    assert read(path) == {peer: {_item(1): 0.0, _item(3): later}}


def test_a_peers_node_is_on_file_and_a_start_keeps_its_deletes_for_that_node(
        tmp_path: Path, secret: Path) -> None:
    """A PEER record names the peer's node once its stream said it: a starting agent that
    no longer has that address parks the peer's DELETEs for its node (`awaynodes`) instead
    of dropping them; another name's, whose node the file does not say, are dropped."""
    path = tmp_path / "peer-deletes"
    moved, unknown = "192.0.2.7:9410", "192.0.2.9:9410"
    dlog, _ = DeleteLog.open(path)
    dlog.wait(_item(1), [moved, unknown])
    dlog.set_node(moved, "node7")  # said after its DELETEs were on file: a record again
    dlog.wait_each(moved, [_item(2)])
    dlog.close()
    saved, nodes = deletelog.read_nodes(path)
    assert nodes == {moved: "node7"}
    assert list(saved[moved]) == [_item(1), _item(2)]
    dlog, _ = DeleteLog.open(path)  # rewritten: the node stays on file
    dlog.close()
    assert deletelog.read_nodes(path)[1] == {moved: "node7"}

    cfg = Peers.model_validate({"enabled": True, "port": free_port(), "address": "127.0.0.1",
                                "secretFile": str(secret), "addresses": []})
    registry = CollectorRegistry()

    async def started() -> dict[str, list[Item]]:
        network = PeerNetwork(cfg, {}, registry, "p", node="node0", deletes_file=path)
        await network.start()
        try:
            return {node: [i for q in away.waiting.values() for i in q]
                    for node, away in network.away.nodes.items()}
        finally:
            await network.close()

    def dropped(name: str) -> float:
        return registry.get_sample_value("kvpool_peer_deletes_total", {
            "pool": "p", "peer": name, "direction": "sent", "result": "dropped"}) or 0

    assert asyncio.run(started()) == {"node7": [_item(1), _item(2)]}
    assert dropped(moved) == 0 and dropped(unknown) == 1
    assert read(path) == {moved: {_item(1): 0.0, _item(2): 0.0}}  # still on file, for node7


def test_a_link_that_goes_hands_its_deletes_to_its_nodes_other_link_or_parks_them(
        tmp_path: Path, secret: Path) -> None:
    """A link whose node another link follows already (its new address listed before the
    old one goes) hands its DELETEs to that link at once; with no such link they wait for
    the node, with every DELETE made meanwhile, until a link names it: on file under each
    link's name in turn."""
    path = tmp_path / "peer-deletes"
    old, new, later = (f"127.0.0.1:{free_port()}" for _ in range(3))  # (nobody listens)
    cfg = Peers.model_validate({"enabled": True, "port": free_port(), "address": "127.0.0.1",
                                "secretFile": str(secret), "addresses": [old, new]})

    def key(name: str) -> tuple[str, int]:
        host, _, port = name.rpartition(":")
        return host, int(port)

    async def run() -> None:
        network = PeerNetwork(cfg, {}, CollectorRegistry(), "p", node="node0",
                              deletes_file=path)
        await network.start()
        try:
            a, b = network.links[key(old)], network.links[key(new)]
            a.node = b.node = "node7"
            a.queue_delete(*_item(1))
            assert network.delete_log is not None
            network.delete_log.wait(_item(1), [old])
            network._unlink(key(old))  # node7 is followed at `new` already
            assert list(b.deletes) == [_item(1)] and not network.away.nodes
            assert read(path) == {new: {_item(1): 0.0}}

            network._unlink(key(new))  # node7 away, nobody follows it
            network.delete("", _item(2)[1], here=True)
            assert {n: list(q) for n, q in network.away.nodes["node7"].waiting.items()} == {
                new: [_item(1), _item(2)]}
            assert read(path) == {new: {_item(1): 0.0, _item(2): 0.0}}

            network._link(*key(later))  # node7 back: its stream names it
            c = network.links[key(later)]
            c.node = "node7"
            network._node_known(c)
            assert list(c.deletes) == [_item(1), _item(2)] and not network.away.nodes
            assert read(path) == {later: {_item(1): 0.0, _item(2): 0.0}}
        finally:
            await network.close()

    asyncio.run(run())


def test_a_start_keeps_a_named_peers_deletes_for_its_node_even_at_a_listed_address(
        tmp_path: Path, secret: Path) -> None:
    """The file's DELETEs of a peer whose node it names wait for that node even where the
    address is still listed: the link there takes them once its stream names that node,
    not before (the address may be another node's pod by now)."""
    path = tmp_path / "peer-deletes"
    there = f"127.0.0.1:{free_port()}"  # (nobody listens)
    dlog, _ = DeleteLog.open(path)
    dlog.set_node(there, "node7")
    dlog.wait_each(there, [_item(1), _item(2)])
    dlog.close()
    cfg = Peers.model_validate({"enabled": True, "port": free_port(), "address": "127.0.0.1",
                                "secretFile": str(secret), "addresses": [there]})
    host, _, port = there.rpartition(":")

    async def run() -> None:
        network = PeerNetwork(cfg, {}, CollectorRegistry(), "p", node="node0",
                              deletes_file=path)
        await network.start()
        try:
            link = network.links[(host, int(port))]
            assert not link.deletes and list(network.away.nodes) == ["node7"]
            link.node = "node8"  # another node's pod at that address now: not its
            network._node_known(link)
            assert not link.deletes and list(network.away.nodes) == ["node7"]
            link.node = "node7"
            network._node_known(link)
            assert list(link.deletes) == [_item(1), _item(2)] and not network.away.nodes
            assert read(path) == {there: {_item(1): 0.0, _item(2): 0.0}}
            # Parked again, and no link names the node within the hour: they go to the
            # link at the address they were last at, listed still (as unnamed peers').
            network._unlink((host, int(port)))
            network._link(host, int(port))
            link = network.links[(host, int(port))]
            assert not link.deletes and list(network.away.nodes) == ["node7"]
            network._expire_away(time.time() + awaynodes.NODE_KEEP + 1)
            assert list(link.deletes) == [_item(1), _item(2)] and not network.away.nodes
            # Unless the link there names another node: then they are dropped.
            link.node = "node7"
            network._unlink((host, int(port)))
            network._link(host, int(port))
            link = network.links[(host, int(port))]
            link.node = "node8"
            network._expire_away(time.time() + awaynodes.NODE_KEEP + 1)
            assert not link.deletes and not network.away.nodes
            assert read(path) == {}
        finally:
            await network.close()

    asyncio.run(run())
