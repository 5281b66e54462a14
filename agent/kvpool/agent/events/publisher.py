"""The publisher: a bounded queue in, vLLM's ZMQ PUB and replay sockets out.

A tier change appends a tuple to a deque (`offer`): when it holds `queueDepth`
events the event is dropped and counted, never waited for. Every `FLUSH_DELAY`
while changes come, the loop takes what gathered (`flush`, at most `DRAIN` events
per turn, yielding between turns), encodes each event once (a chunk named by
kvpool's own key from a template: no Python object per event), groups them into
one `KVEventBatch` per topic and sends it, without waiting, with the topic's next
sequence number (the PUB socket drops for a subscriber past its high-water mark).

This runs on the event loop, not in a thread of its own: the agent's Python runs
one thread at a time (the GIL), so a publisher thread saves the loop no work, and
handing the GIL to it and back cost puts more than the publishing itself (in
`kvpool bench`, a put of 64 KiB chunks stalled about a millisecond a round on a
loaded 2-core machine, docs/events.md). The last `replayDepth` batches are kept for
the ROUTER replay socket, which a thread of its own serves: replays are rare and
may be long.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from ..config import ConfigError, EventsPayload, TierName
from . import wire
from .identity import Identity, block_of, model_of

log = logging.getLogger("kvpool.agent.events")

DRAIN = 1024
"""Most events one turn of the loop encodes and sends (a batch's size, the replay's
memory and the time a turn holds the loop are bounded by it)."""
FLUSH_DELAY = 0.01
"""Seconds events gather before the loop publishes them: one send per topic for a
burst of changes, not one per change."""
SEND_HWM = 100_000
"""Messages the PUB socket queues per subscriber before dropping (ZMQ's high-water mark)."""


Change = tuple[str, bool, TierName, bytes, Identity | None]
"""(space, stored, tier, key, identity): a chunk entered (`stored`) or left a tier of a
space; identity: what its storing client said of it (model, blocks), None: nothing.
A plain tuple: the loop queues one per tier change, inside puts."""


@dataclass(slots=True)
class TopicStart:
    """A topic begins (a pod's first connection, or the agent's start in node mode):
    AllBlocksCleared, then BlockStored for every chunk of the inventory."""

    space: str
    topic: str
    model: str
    """The pod's model ("" in node mode: every chunk goes to the topic)."""
    inventory: list[tuple[TierName, bytes, Identity | None]] = field(default_factory=list)


@dataclass(slots=True)
class TopicEnd:
    space: str
    topic: str


Item = Change | TopicStart | TopicEnd


class Publisher:
    def __init__(self, *, host: str, port: int, replay_port: int | None, replay_depth: int,
                 queue_depth: int, shape: EventsPayload, medium: dict[TierName, str],
                 published: Callable[[int], None], dropped: Callable[[int], None]) -> None:
        self.shape = shape
        self.medium = medium
        self._own = {(stored, tier): wire.own_key_template(shape, stored, m)
                     for tier, m in medium.items() for stored in (True, False)}
        """(prefix, suffix) of the event of a chunk named by kvpool's own key, per
        (stored, tier): prefix + key[:8] + suffix is the encoded event."""
        self.queue_depth = queue_depth
        self._published = published
        self._dropped = dropped
        self._queue: collections.deque[Item] = collections.deque()
        self._flush_due = False
        """A flush is scheduled on the loop (`offer`)."""
        self._closed = False
        self._starting: tuple[bytes, str, collections.deque[
            tuple[TierName, bytes, Identity | None]]] | None = None
        """(topic, model, inventory left) of a topic start being published, a turn at a
        time; the queue waits behind it."""
        self._stop = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self.endpoint = _bind(self._pub, host, port)
            self.replay_endpoint: str | None = None
            if replay_port is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, host, replay_port)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(f"events: cannot bind tcp://{host}:{port} or its replay port "
                              f"{replay_port}: {e}") from e
        self._buffer: collections.deque[tuple[bytes, int, bytes]] = collections.deque(
            maxlen=replay_depth)
        """(topic, seq, payload) of the last batches, for replay."""
        self._seq: dict[bytes, int] = {}
        """Next sequence number of each topic."""
        self._topics: dict[str, dict[bytes, str]] = {}
        """Live topics of each space, with their model ("" takes every chunk)."""
        self._thread: threading.Thread | None = None
        if self._replay is not None:
            self._thread = threading.Thread(target=self._run_replay, name="kvpool-replay",
                                            daemon=True)
            self._thread.start()

    # -- the loop's side

    def offer(self, item: Item) -> None:
        """Queue a change; a full queue drops it (counted). Topic starts and ends are
        never dropped: they are rare, and a topic must begin with its inventory."""
        q = self._queue
        if len(q) >= self.queue_depth and type(item) is tuple:
            self._dropped(1)
            return
        q.append(item)
        if not self._flush_due:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # at start, before the loop runs: nothing to hold up
                self._publish_all()
                return
            self._flush_due = True
            loop.call_later(FLUSH_DELAY, self._flush)

    def _flush(self) -> None:
        """One turn: publish up to DRAIN events; another turn soon if more wait."""
        if self._closed:
            return
        self._flush_due = False
        try:
            self._drain()
        except Exception:  # the data path must not care: log, drop, carry on
            log.exception("publishing KV events failed; %d queued dropped", len(self._queue))
            self._dropped(len(self._queue))
            self._queue.clear()
            self._starting = None
        if self._queue or self._starting is not None:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _publish_all(self) -> None:
        while self._queue or self._starting is not None:
            self._drain()

    def close(self) -> None:
        """Publish what is queued, then stop the replay thread and close the sockets."""
        with contextlib.suppress(Exception):
            self._publish_all()
        self._queue.clear()
        self._closed = self._flush_due = True  # no flush from now on
        os.eventfd_write(self._stop, 1)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._close_sockets()
        os.close(self._stop)

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _drain(self) -> None:
        """Publish up to DRAIN events: the topic start under way first, then the queue,
        one batch per topic for the changes taken."""
        budget = DRAIN
        if self._starting is not None:
            budget -= self._continue_start(budget)
            if self._starting is not None:
                return
        pending: dict[bytes, list[bytes]] = {}
        counted = 0
        q = self._queue
        own = self._own
        for _ in range(min(budget, len(q))):
            item = q.popleft()
            if type(item) is tuple:
                space, stored, tier, key, ident = item
                topics = self._topics.get(space)
                if not topics:
                    continue
                if ident is None:
                    prefix, suffix = own[stored, tier]
                    payload = prefix + key[:8] + suffix
                    chunk_model = ""
                else:
                    payload = self._encode(stored, tier, key, ident)
                    chunk_model = ident.model
                sent = False
                for topic, model in topics.items():
                    if model and chunk_model and model != chunk_model:
                        continue
                    events = pending.get(topic)
                    if events is None:
                        events = pending[topic] = []
                    events.append(payload)
                    sent = True
                counted += sent
                continue
            self._flush_pending(pending)  # what came before a topic change goes out first
            pending = {}
            if isinstance(item, TopicStart):
                self._begin_start(item)
                break  # its inventory takes the next turns; the queue waits behind it
            if isinstance(item, TopicEnd):
                self._topics.get(item.space, {}).pop(item.topic.encode(), None)
        self._flush_pending(pending)
        if counted:
            self._published(counted)

    def _begin_start(self, item: TopicStart) -> None:
        topic = item.topic.encode()
        self._topics.setdefault(item.space, {})[topic] = item.model
        # A topic counts on from its start time (microseconds since the epoch), not from 0:
        # a restarted agent's or pod's topic continues upward, so its subscribers see a
        # gap and replay from where they stopped, which starts at AllBlocksCleared.
        self._seq[topic] = max(time.time_ns() // 1000, self._seq.get(topic, 0))
        self._send(topic, [wire.cleared(self.shape)])
        self._published(1)
        self._starting = (topic, item.model, collections.deque(item.inventory))

    def _continue_start(self, budget: int) -> int:
        """BlockStored for up to `budget` chunks of the starting topic's inventory; the
        number taken."""
        assert self._starting is not None
        topic, pod_model, left = self._starting
        events: list[bytes] = []
        taken = 0
        while left and taken < budget:
            tier, key, ident = left.popleft()
            taken += 1
            model = model_of(ident)
            if pod_model and model and model != pod_model:
                continue
            events.append(self._encode(True, tier, key, ident))
        if events:
            self._send(topic, events)
            self._published(len(events))
        if not left:
            self._starting = None
        return taken

    def _encode(self, stored: bool, tier: TierName, key: bytes,
                ident: Identity | None) -> bytes:
        if ident is None:
            prefix, suffix = self._own[stored, tier]
            return prefix + key[:8] + suffix
        medium = self.medium[tier]
        hashes, parent, tokens, block_size = block_of(key, ident)
        if stored:
            return wire.stored(self.shape, hashes, parent, tokens, block_size, medium)
        return wire.removed(self.shape, hashes, medium)

    def _flush_pending(self, pending: dict[bytes, list[bytes]]) -> None:
        for topic, events in pending.items():
            self._send(topic, events)

    def _send(self, topic: bytes, events: list[bytes]) -> None:
        seq = self._seq.get(topic, 0)
        self._seq[topic] = seq + 1
        payload = wire.batch(time.time(), events)
        with contextlib.suppress(zmq.Again):  # PUB drops rather than block: a gap
            self._pub.send_multipart((topic, wire.SEQ.pack(seq), payload), zmq.NOBLOCK,
                                     copy=False)
        if self._buffer.maxlen:
            self._buffer.append((topic, seq, payload))

    # -- the replay thread

    def _run_replay(self) -> None:
        assert self._replay is not None
        poller = zmq.Poller()
        poller.register(self._stop, zmq.POLLIN)
        poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._stop in ready:
                    return
                self._serve_replay()
        except Exception:  # the data path must not care: log, and stop serving replays
            log.exception("the KV-event replay thread stopped")

    def _serve_replay(self) -> None:
        """Answer every waiting replay request: `[start_seq]` (vLLM's: every topic) or
        `[topic, start_seq]` (that topic only); each kept batch from there as
        `(seq, payload)`, then `(-1, b"")`."""
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident, rest = frames[0], frames[1:]
            if rest and rest[0] == b"":
                rest = rest[1:]  # a REQ client's delimiter
            topic: bytes | None = None
            if len(rest) == 2:
                topic, rest = rest[0], rest[1:]
            if len(rest) != 1 or len(rest[0]) != 8:
                log.warning("malformed replay request of %d frames: ignored", len(frames))
                self._replay.send_multipart((ident, b"", wire.END_SEQ, b""))
                continue
            start = int.from_bytes(rest[0], "big")
            for t, seq, payload in list(self._buffer):  # a copy: the loop appends
                if seq >= start and (topic is None or t == topic):
                    self._replay.send_multipart((ident, b"", wire.SEQ.pack(seq), payload))
            self._replay.send_multipart((ident, b"", wire.END_SEQ, b""))


def _bind(sock: zmq.Socket[bytes], host: str, port: int) -> str:
    """Bind `tcp://host:port` (port 0: any free one); the endpoint bound."""
    if port == 0:
        got = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{got}"
    sock.bind(f"tcp://{host}:{port}")
    endpoint: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return endpoint
