"""The publisher thread: a bounded queue in, vLLM's ZMQ PUB and replay sockets out.

The event loop only appends to a deque (`offer`): when it holds `queueDepth`
events the event is dropped and counted, never waited for. A thread drains it,
encodes each event once, groups what one drain took into one `KVEventBatch` per
topic, and sends it with the topic's next sequence number. The last
`replayDepth` batches are kept for the ROUTER replay socket, served by the same
thread. The thread wakes on an eventfd the loop writes when the queue turns
non-empty, or on a replay request.
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

DRAIN = 4096
"""Most queue items one batch takes: bounds a batch's size and the replay's memory."""
WAKE_DELAY = 0.002
"""Seconds the loop lets events gather before it wakes the publisher thread."""
SEND_HWM = 100_000
"""Messages the PUB socket queues per subscriber before dropping (ZMQ's high-water mark)."""


@dataclass(slots=True)
class Change:
    """A chunk entered (`stored`) or left a tier of a space."""

    space: str
    stored: bool
    tier: TierName
    key: bytes
    identity: Identity | None
    """What its storing client said of it (model, blocks); None: nothing."""


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
        self.queue_depth = queue_depth
        self._published = published
        self._dropped = dropped
        self._queue: collections.deque[Item] = collections.deque()
        self._wake_due = False
        """A wake-up of the thread is scheduled on the loop (`offer`)."""
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stopping = False
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
        self._thread = threading.Thread(target=self._run, name="kvpool-events", daemon=True)
        self._thread.start()

    # -- the loop's side

    def offer(self, item: Item) -> None:
        """Queue a change; a full queue drops it (counted). Topic starts and ends are
        never dropped: they are rare, and a topic must begin with its inventory."""
        q = self._queue
        if isinstance(item, Change) and len(q) >= self.queue_depth:
            self._dropped(1)
            return
        q.append(item)
        if len(q) == 1 and not self._wake_due:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # at start, before the loop runs
                os.eventfd_write(self._wake, 1)
                return
            # One wake-up per WAKE_DELAY, not one per event: the thread then takes the GIL
            # once for the lot, and a put that stores a window of chunks is not
            # interrupted once per chunk.
            self._wake_due = True
            loop.call_later(WAKE_DELAY, self._wake_now)

    def _wake_now(self) -> None:
        self._wake_due = False
        os.eventfd_write(self._wake, 1)

    def close(self) -> None:
        """Publish what is queued, then stop the thread and close the sockets."""
        self._stopping = True
        os.eventfd_write(self._wake, 1)
        self._thread.join(timeout=10)
        self._close_sockets()
        os.close(self._wake)

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    # -- the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._wake)
                while self._queue:
                    self._drain()
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
                if self._stopping:
                    return
        except Exception:  # the data path must not care: log, and stop publishing
            log.exception("the KV-event publisher stopped")

    def _drain(self) -> None:
        """Take up to DRAIN items; one batch per topic for the changes among them."""
        pending: dict[bytes, list[bytes]] = {}
        counted = 0
        q = self._queue
        for _ in range(DRAIN):
            try:
                item = q.popleft()
            except IndexError:
                break
            if isinstance(item, Change):
                topics = self._topics.get(item.space)
                if not topics:
                    continue
                payload = self._encode(item.stored, item.tier, item.key, item.identity)
                chunk_model = model_of(item.identity)
                sent = False
                for topic, model in topics.items():
                    if model and chunk_model and model != chunk_model:
                        continue
                    pending.setdefault(topic, []).append(payload)
                    sent = True
                counted += sent
                continue
            self._flush(pending)  # what came before a topic change goes out before it
            pending = {}
            if isinstance(item, TopicStart):
                self._start(item)
            else:
                self._topics.get(item.space, {}).pop(item.topic.encode(), None)
        self._flush(pending)
        if counted:
            self._published(counted)

    def _start(self, item: TopicStart) -> None:
        topic = item.topic.encode()
        self._topics.setdefault(item.space, {})[topic] = item.model
        # A topic counts on from its start time (microseconds since the epoch), not from 0:
        # a restarted agent's or pod's topic continues upward, so its subscribers see a
        # gap and replay from where they stopped, which starts at AllBlocksCleared.
        self._seq[topic] = max(time.time_ns() // 1000, self._seq.get(topic, 0))
        events = [wire.cleared(self.shape)]
        for tier, key, ident in item.inventory:
            model = model_of(ident)
            if item.model and model and model != item.model:
                continue
            events.append(self._encode(True, tier, key, ident))
        for i in range(0, len(events), DRAIN):
            self._send(topic, events[i : i + DRAIN])
        self._published(len(events))

    def _encode(self, stored: bool, tier: TierName, key: bytes,
                ident: Identity | None) -> bytes:
        medium = self.medium[tier]
        hashes, parent, tokens, block_size = block_of(key, ident)
        if stored:
            return wire.stored(self.shape, hashes, parent, tokens, block_size, medium)
        return wire.removed(self.shape, hashes, medium)

    def _flush(self, pending: dict[bytes, list[bytes]]) -> None:
        for topic, events in pending.items():
            self._send(topic, events)

    def _send(self, topic: bytes, events: list[bytes]) -> None:
        seq = self._seq.get(topic, 0)
        self._seq[topic] = seq + 1
        payload = wire.batch(time.time(), events)
        self._pub.send_multipart((topic, wire.SEQ.pack(seq), payload), copy=False)
        if self._buffer.maxlen:
            self._buffer.append((topic, seq, payload))

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
            for t, seq, payload in list(self._buffer):
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
