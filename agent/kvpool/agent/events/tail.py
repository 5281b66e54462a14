"""`kvpool events`: subscribe to an agent's KV events and say each in one line.

Decoding is kvpool's own (`wire`), both payload shapes. A gap in a topic's sequence
numbers is reported as a line of its own (`# gap ...`); so is a topic's start.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import zmq

from . import wire

SHOWN_HASHES = 4
"""Block hashes a line shows before it says how many more there are."""


def endpoint_of(stats: dict[str, Any]) -> str:
    """The PUB endpoint an agent's STATS names (its `events` entry); ValueError if off."""
    ev = stats.get("events")
    if not isinstance(ev, dict):
        raise ValueError("this agent publishes no KV events (events.enabled is false)")
    host = ev.get("address", "*")
    if host in ("*", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"tcp://{host}:{ev['port']}"


def describe(seq: int, topic: str, event: wire.AnyEvent) -> str:
    """One event as a line: sequence, topic, type, medium, blocks."""
    name = wire.event_name(event)
    parts = [str(seq), topic, name]
    medium = getattr(event, "medium", None)
    if medium is not None:
        parts.append(f"medium={medium}")
    hashes: list[int] | None = getattr(event, "block_hashes", None)
    if hashes is not None:
        shown = ",".join(f"{h:x}" for h in hashes[:SHOWN_HASHES])
        more = f",+{len(hashes) - SHOWN_HASHES}" if len(hashes) > SHOWN_HASHES else ""
        parts.append(f"blocks={shown}{more}")
    tokens: list[int] | None = getattr(event, "token_ids", None)
    if tokens:
        parts.append(f"tokens={len(tokens)}")
    block_size = getattr(event, "block_size", 0)
    if block_size:
        parts.append(f"block_size={block_size}")
    return " ".join(parts)


def lines(endpoint: str, topic: str = "", idle: float | None = None) -> Iterator[str]:
    """Lines for the events published at `endpoint` under topics starting with `topic`,
    as they come; ends after `idle` seconds without any (None: never)."""
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    try:
        sub.connect(endpoint)
    except zmq.ZMQError as e:
        sub.close()
        ctx.term()
        raise ValueError(f"cannot subscribe to {endpoint}: {e}") from e
    last: dict[bytes, int] = {}
    try:
        while sub.poll(None if idle is None else int(idle * 1000)):
            t, seq_b, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            name = t.decode(errors="replace")
            before = last.get(t)
            if before is not None and seq != before + 1:
                yield f"# gap on {name}: expected {before + 1}, got {seq}"
            last[t] = seq
            for event in wire.decode_any(payload).events:
                yield describe(seq, name, event)
    finally:
        sub.close()
        ctx.term()
