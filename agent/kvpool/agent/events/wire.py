"""vLLM's KV-event wire format: the payload structs and their two shapes.

A published message is three ZMQ frames: topic, sequence number (8 bytes,
big-endian) and a MessagePack `KVEventBatch` = `[ts, events, data_parallel_rank]`.
Each event is a map tagged by `"type"` (vLLM since #42892, SGLang, llm-d, Dynamo)
or an array led by the tag (older vLLM, AIBrix, kthena); `EventsPayload` picks.
Field names and order are vLLM's (`vllm/distributed/kv_events.py`).
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from ..config import EventsPayload

SEQ = struct.Struct(">Q")
"""The sequence-number frame of a published message."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end marker: sequence -1 with an empty payload."""


# -- the events' fields, in vLLM's order: the same in both shapes


class _Stored(msgspec.Struct, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class _Removed(msgspec.Struct, gc=False):
    block_hashes: list[int]
    medium: str | None = None


# -- map shape: {"type": "BlockStored", ...}


class _MapEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class BlockStored(_Stored, _MapEvent):
    pass


class BlockRemoved(_Removed, _MapEvent):
    pass


class AllBlocksCleared(_MapEvent):
    pass


# -- array shape: ["BlockStored", ...]


class _ArrayEvent(msgspec.Struct, array_like=True, tag=True, omit_defaults=True, gc=False):
    pass


class ArrayBlockStored(_Stored, _ArrayEvent, tag="BlockStored"):
    pass


class ArrayBlockRemoved(_Removed, _ArrayEvent, tag="BlockRemoved"):
    pass


class ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


MapEvent = BlockStored | BlockRemoved | AllBlocksCleared
ArrayEvent = ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared
AnyEvent = MapEvent | ArrayEvent


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = 0


class MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[MapEvent]
    data_parallel_rank: int | None = None


class ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[ArrayEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_map_decoder = msgspec.msgpack.Decoder(MapBatch)
_array_decoder = msgspec.msgpack.Decoder(ArrayBatch)


def stored(shape: EventsPayload, hashes: list[int], parent: int | None, tokens: list[int],
           block_size: int, medium: str) -> bytes:
    """One encoded BlockStored event (encoded once, sent under every topic it goes to)."""
    cls = BlockStored if shape is EventsPayload.MAP else ArrayBlockStored
    return _encoder.encode(cls(hashes, parent, tokens, block_size, None, medium))


def removed(shape: EventsPayload, hashes: list[int], medium: str) -> bytes:
    cls = BlockRemoved if shape is EventsPayload.MAP else ArrayBlockRemoved
    return _encoder.encode(cls(hashes, medium))


def cleared(shape: EventsPayload) -> bytes:
    return _encoder.encode(AllBlocksCleared() if shape is EventsPayload.MAP
                           else ArrayAllBlocksCleared())


_MARK = (1 << 64) - 1
_MARK_BYTES = b"\xcf" + _MARK.to_bytes(8, "big")
"""How MessagePack writes `_MARK`: a uint64, 0xcf then 8 bytes big-endian."""


def own_key_template(shape: EventsPayload, is_stored: bool, medium: str) -> tuple[bytes, bytes]:
    """(prefix, suffix) of the event of a chunk named by kvpool's own key (one block, its
    hash the key's first 8 bytes, no tokens, block size 0): `prefix + key[:8] + suffix`
    is that event, the hash written as a uint64 (0xcf and 8 bytes big-endian), which
    every MessagePack decoder reads as the same integer `stored`/`removed` would write
    in fewer bytes. The publisher builds such events without a Python object each."""
    enc = (stored(shape, [_MARK], None, [], 0, medium) if is_stored
           else removed(shape, [_MARK], medium))
    at = enc.index(_MARK_BYTES)
    return enc[: at + 1], enc[at + len(_MARK_BYTES) :]


_BATCH_HEAD = b"\x93\xcb"
"""A KVEventBatch's first bytes: an array of 3, then the timestamp as a float64."""
_RANK_0 = b"\x00"


def batch(ts: float, events: list[bytes]) -> bytes:
    """A KVEventBatch `[ts, events, 0]` of events already encoded, written directly (no
    msgspec.Raw per event): what `msgspec` writes for the same batch."""
    n = len(events)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return b"".join((_BATCH_HEAD, _TS.pack(ts), head, *events, _RANK_0))


_TS = struct.Struct(">d")


def decode(payload: bytes, shape: EventsPayload) -> MapBatch | ArrayBatch:
    """A batch as kvpool publishes it (for `kvpool events` and tests)."""
    if shape is EventsPayload.MAP:
        return _map_decoder.decode(payload)
    return _array_decoder.decode(payload)


def decode_any(payload: bytes) -> MapBatch | ArrayBatch:
    """A batch of either shape: map first, then array."""
    try:
        return decode(payload, EventsPayload.MAP)
    except msgspec.ValidationError:
        return decode(payload, EventsPayload.ARRAY)


def event_name(event: AnyEvent) -> str:
    name: str = type(event).__struct_config__.tag  # type: ignore[assignment]
    return name
