"""The chunk store: what every socket op does, across the agent's tiers.

The server decodes frames and calls these methods; they raise `OpError` with
a protocol error code for anything a client did wrong. Nothing here touches
the socket, so the store's behaviour is testable on its own and the server
stays a thin shell.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from .config import AgentConfig, TierPolicy
from .keys import KEY_BYTES
from .metrics import AgentMetrics
from .protocol import MAX_LOOKUP_KEYS, ErrorCode, Extents, checksum
from .tiers.dram import DramChunk, DramTier

MAX_LEASES_PER_CLIENT = 4096


class OpError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class Granted:
    lease: int
    extents: Extents
    size: int = 0
    checksum: int = 0
    meta: bytes = b""
    tier: int = 2


def check_key(key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise OpError(ErrorCode.BAD_KEY, f"a key is {KEY_BYTES} bytes, got {len(key)}")


class ChunkStore:
    def __init__(self, config: AgentConfig, dram: DramTier, metrics: AgentMetrics,
                 policy: TierPolicy) -> None:
        self.config = config
        self.dram = dram
        self.m = metrics
        self.policy = policy
        self.dram.pins.update(bytes.fromhex(k) for k in policy.pins)

    # -- policy

    def set_policy(self, policy: TierPolicy) -> None:
        """Apply a new policy in place: nothing is flushed, only pins are re-derived."""
        old = {bytes.fromhex(k) for k in self.policy.pins}
        new = {bytes.fromhex(k) for k in policy.pins}
        self.dram.pins -= old - new
        self.dram.pins |= new
        self.policy = policy

    # -- lookups

    def lookup(self, keys: list[bytes]) -> tuple[int, bytes]:
        if len(keys) > MAX_LOOKUP_KEYS:
            raise OpError(ErrorCode.BAD_ARGUMENT,
                          f"LOOKUP takes at most {MAX_LOOKUP_KEYS} keys, got {len(keys)}")
        for k in keys:
            check_key(k)
        self.m.lookups.inc()
        self.m.lookup_keys.inc(len(keys))
        count = 0
        for k in keys:
            chunk = self.dram.get(k)
            if chunk is None:
                break
            count += 1
        if count:
            self.m.hits["dram"].inc(count)
        if count < len(keys):
            self.m.misses["dram"].inc(len(keys) - count)
        return count, bytes([2]) * count

    def contains(self, key: bytes) -> bool:
        return self.dram.get(key) is not None

    # -- zero-copy writes

    def alloc(self, key: bytes, size: int, meta: bytes, tenant: str, owner: int) -> Granted | None:
        """A write lease on fresh extents, or None when the key is already stored."""
        check_key(key)
        self._check_size(size, meta)
        if self.dram.get(key) is not None:
            return None
        self._check_lease_budget(owner)
        extents = self._allocate(size)
        lease = self.dram.open_write(key, extents, size, meta, tenant, owner,
                                     self.config.write_lease_timeout)
        return Granted(lease.id, extents, size)

    def commit(self, lease_id: int, checksum_: int, owner: int) -> None:
        lease = self.dram.close_write(lease_id, owner)
        if lease is None:
            raise OpError(ErrorCode.UNKNOWN_LEASE,
                          f"write lease {lease_id} is not open on this connection")
        if self.dram.get(lease.key) is not None:
            # Another client committed the same key first: keep theirs.
            self.dram.alloc.free(lease.extents)
            return
        self.dram.insert(lease.key, lease.extents, lease.size, checksum_ & (2**64 - 1),
                         lease.meta, lease.tenant)
        self.m.written_bytes["dram"].inc(lease.size)

    def abort(self, lease_id: int, owner: int) -> None:
        lease = self.dram.close_write(lease_id, owner)
        if lease is None:
            raise OpError(ErrorCode.UNKNOWN_LEASE,
                          f"write lease {lease_id} is not open on this connection")
        self.dram.alloc.free(lease.extents)

    # -- zero-copy reads

    def acquire(self, key: bytes, owner: int) -> Granted:
        check_key(key)
        chunk = self._find(key)
        self._check_lease_budget(owner)
        lease = self.dram.open_read(chunk, owner)
        self.m.read_bytes["dram"].inc(chunk.size)
        return Granted(lease.id, chunk.extents, chunk.size, chunk.checksum, chunk.meta, 2)

    def release(self, lease_id: int, owner: int) -> None:
        if not self.dram.close_read(lease_id, owner):
            raise OpError(ErrorCode.UNKNOWN_LEASE,
                          f"read lease {lease_id} is not open on this connection")

    # -- inline

    def put(self, key: bytes, data: bytes, checksum_: int, meta: bytes, tenant: str) -> bool:
        check_key(key)
        self._check_size(len(data), meta)
        if checksum(data, meta) != checksum_:
            raise OpError(ErrorCode.CHECKSUM_MISMATCH,
                          "the PUT bytes do not match their checksum; nothing stored")
        if self.dram.get(key) is not None:
            return False
        extents = self._allocate(len(data))
        self.dram.arena.write(extents, data)
        self.dram.insert(key, extents, len(data), checksum_, meta, tenant)
        self.m.written_bytes["dram"].inc(len(data))
        return True

    def get(self, key: bytes) -> tuple[bytes, DramChunk]:
        check_key(key)
        chunk = self._find(key)
        data = self.dram.arena.read(chunk.extents)
        self.m.read_bytes["dram"].inc(chunk.size)
        return data, chunk

    # -- management

    def delete(self, key: bytes) -> bool:
        check_key(key)
        self.dram.pins.discard(key)
        return self.dram.remove(key) is not None

    def pin(self, key: bytes) -> None:
        check_key(key)
        if self.dram.get(key) is None:
            raise OpError(ErrorCode.NOT_FOUND, f"cannot pin {key.hex()}: not stored")
        self.dram.pins.add(key)

    def unpin(self, key: bytes) -> None:
        check_key(key)
        self.dram.pins.discard(key)

    def disconnect(self, owner: int) -> None:
        """A connection closed: abort its writes and end its reads."""
        writes, reads = self.dram.leases_of(owner)
        for lease_id in writes:
            self.abort(lease_id, owner)
        for lease_id in reads:
            self.dram.close_read(lease_id, owner)

    def expire_writes(self, now: float | None = None) -> int:
        expired = self.dram.expired_writes(time.monotonic() if now is None else now)
        for lease in expired:
            self.abort(lease.id, lease.owner)
        return len(expired)

    def stats(self) -> dict[str, object]:
        d = self.dram
        return {
            "pool": self.config.pool,
            "tiers": {
                "dram": {
                    "capacity_bytes": d.capacity_bytes,
                    "used_bytes": d.used_bytes,
                    "chunks": len(d.chunks),
                    "hits": int(self.m.hits["dram"]._value.get()),
                    "misses": int(self.m.misses["dram"]._value.get()),
                    "healthy": True,
                    "locked_bytes": d.arena.locked_bytes,
                    "lock_error": d.arena.lock_error or "",
                },
            },
            "leases": {"read": len(d.reads), "write": len(d.writes)},
            "pins": len(d.pins),
        }

    def state_samples(self) -> Iterable[tuple[str, str, dict[str, str], float]]:
        d = self.dram
        yield ("kvpool_tier_capacity_bytes", "Tier capacity", {"tier": "dram"},
               d.capacity_bytes)
        yield ("kvpool_tier_used_bytes", "Bytes held in the tier", {"tier": "dram"},
               d.used_bytes)
        yield ("kvpool_tier_chunks", "Chunks held in the tier", {"tier": "dram"}, len(d.chunks))
        yield ("kvpool_tier_healthy", "1 when the tier serves", {"tier": "dram"}, 1)
        yield ("kvpool_leases", "Open leases", {"kind": "read"}, len(d.reads))
        yield ("kvpool_leases", "Open leases", {"kind": "write"}, len(d.writes))
        yield ("kvpool_dram_locked_bytes", "Arena bytes locked in RAM", {},
               d.arena.locked_bytes)

    # -- internals

    def _find(self, key: bytes) -> DramChunk:
        chunk = self.dram.get(key)
        if chunk is None:
            raise OpError(ErrorCode.NOT_FOUND, f"{key.hex()} is not stored")
        self.dram.touch(chunk)
        return chunk

    def _check_size(self, size: int, meta: bytes) -> None:
        if not 0 < size <= self.config.max_chunk_bytes:
            raise OpError(ErrorCode.BAD_ARGUMENT,
                          f"chunk size {size} is outside 1..{self.config.max_chunk_bytes}")
        if len(meta) > self.config.max_meta_bytes:
            raise OpError(ErrorCode.BAD_ARGUMENT,
                          f"metadata of {len(meta)} bytes exceeds {self.config.max_meta_bytes}")

    def _check_lease_budget(self, owner: int) -> None:
        writes, reads = self.dram.leases_of(owner)
        if len(writes) + len(reads) >= MAX_LEASES_PER_CLIENT:
            raise OpError(ErrorCode.TOO_MANY_LEASES,
                          f"this connection holds {MAX_LEASES_PER_CLIENT} leases; release some")

    def _allocate(self, size: int) -> Extents:
        """Extents for a new chunk, evicting least recently used chunks as needed."""
        extents = self.dram.alloc.alloc(size)
        if extents is not None:
            return extents
        for victim in list(self.dram.evictable()):
            self.dram.remove(victim.key)
            self.m.evictions[("dram", "capacity")].inc()
            extents = self.dram.alloc.alloc(size)
            if extents is not None:
                return extents
        raise OpError(ErrorCode.NO_SPACE,
                      f"no room for {size} bytes: the arena's chunks are all leased or pinned")
