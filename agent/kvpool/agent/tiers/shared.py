"""G4: the shared tier, common to every backend (S3 objects, files on a shared mount).

Every node of a pool points at the same bucket prefix or directory. Objects
are named by chunk key alone (`<key hex>.kvc`, see `object_name`): the key is
a chained hash seeded with the layout fingerprint (model, dtype, shapes,
tenant), so it already addresses the content by fingerprint and key, and a
LOOKUP, which carries keys but no fingerprint, can find an object without a
second index. The fingerprint id is in the blob header, like in G3.

This module holds what the backends share: health (a store error or timeout
turns the tier unhealthy with a reason; while unhealthy every call fails fast
and `probe()` brings it back), presence checks bounded in time with a short
negative cache (`contains_many`), request metrics, and the integrity rule (a
blob whose checksum does not match is deleted, counted and reported as
IntegrityError, never served). Backends implement a handful of `_store_*`
primitives that talk to the store and nothing else.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from ..constants import CHUNK_SUFFIX as SUFFIX
from ..constants import KEY_BYTES
from . import base
from .base import ChunkRecord, ChunkTier, IntegrityError
from .daemonpool import DaemonPool, PoolFull

if TYPE_CHECKING:
    from ..config import SharedTier
    from ..metrics import AgentMetrics

log = logging.getLogger(__name__)

LOOKUP_THREADS = 16
"""Presence checks in flight at once (HEADs for S3, stats for a mount)."""
READ_THREADS = 4
"""Object reads in flight at once, in the tier's own threads: a store that stalls ties up
these, never the agent's NVMe reads; as many more may wait, the rest are refused."""
_NEGATIVE_CACHE_MAX = 200_000
"""Entries before the negative cache is pruned; bounds its memory (~100 bytes each)."""

T = TypeVar("T")


class SharedTierUnavailable(ConnectionError):
    """The shared tier is unhealthy: the call failed fast without asking the store."""


class SharedStoreError(OSError):
    """The store answered with an error (the original is the __cause__)."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One stored object, as a listing sees it."""

    name: str
    """Object key (S3) or path (file)."""
    key: bytes | None
    """Chunk key; None for a leftover of an interrupted write (temp file, S3 upload)."""
    size: int
    last_modified: float
    """Seconds since the epoch (S3 LastModified or upload start, file mtime)."""
    upload_id: str = ""
    """For an unfinished S3 multipart upload: its id (removing it aborts the upload)."""


def object_name(key: bytes) -> str:
    """The object's base name: the same for every backend and every node."""
    return f"{key.hex()}{SUFFIX}"


def key_of(name: str) -> bytes | None:
    """The chunk key in an object's base name, or None if it is not a chunk object."""
    if not name.endswith(SUFFIX):
        return None
    stem = name[: -len(SUFFIX)]
    if len(stem) != 2 * KEY_BYTES:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


class _Op:
    """Times one store request and counts it (metrics are optional)."""

    def __init__(self, metrics: AgentMetrics | None, op: str) -> None:
        self.metrics, self.op, self.t0 = metrics, op, time.perf_counter()

    def done(self, ok: bool) -> None:
        if self.metrics is None:
            return
        self.metrics.shared_latency[self.op].observe(time.perf_counter() - self.t0)
        self.metrics.shared_requests[(self.op, "ok" if ok else "error")].inc()


class SharedChunkTier(ChunkTier):
    """Health, bounded presence checks and integrity for a shared store."""

    name = "shared"
    scheme = ""
    """URL scheme, used in health reasons ("s3 unreachable: ...")."""
    presence_batch = 1
    """Keys one presence task checks in turn (1 for a network store: HEADs go in parallel)."""

    def __init__(self, cfg: SharedTier, metrics: AgentMetrics | None = None) -> None:
        self.url = cfg.url
        self.metrics = metrics
        self.request_timeout = float(cfg.request_timeout)
        self.lookup_budget = float(cfg.lookup_budget)
        self.negative_cache_ttl = float(cfg.negative_cache_ttl)
        self._unhealthy = ""
        self._health_lock = threading.Lock()
        self._absent: dict[bytes, float] = {}
        self._absent_lock = threading.Lock()
        self._usage = (0, 0)
        self._pool = DaemonPool(LOOKUP_THREADS, "kvpool-shared")
        self._reads = DaemonPool(READ_THREADS, "kvpool-shared-read", max_queued=READ_THREADS)
        self._stalled = 0
        """Reads that outlived the request timeout and have not returned yet."""

    # -- what a backend implements: raw store access, no health or metrics

    @abstractmethod
    def _store_head(self, key: bytes) -> bool: ...

    @abstractmethod
    def _store_get(self, key: bytes) -> bytes | None: ...

    def _store_read(self, key: bytes) -> ChunkRecord | IntegrityError | None:
        """The verified chunk of `key`; None when absent; an IntegrityError (returned, not
        raised: a corrupt object is not a failed request) when it fails its checks. By
        default the whole object and then `base.decode`; a backend that can hash while it
        reads overrides this (file://: `base.read_chunk_file`)."""
        blob = self._store_get(key)
        if blob is None:
            return None
        try:
            return base.decode(blob, expect_key=key)
        except IntegrityError as e:
            return e

    @abstractmethod
    def _store_put(self, rec: ChunkRecord) -> None: ...

    @abstractmethod
    def _store_delete(self, key: bytes) -> bool: ...

    @abstractmethod
    def _store_list(self) -> Iterator[ObjectInfo]: ...

    @abstractmethod
    def _store_remove(self, objs: Sequence[ObjectInfo]) -> int:
        """Delete listed objects (chunks or leftovers); returns how many failed."""

    @abstractmethod
    def _store_probe(self) -> None:
        """Cheapest request that proves the store answers; raises when it does not."""

    @abstractmethod
    def _outage(self, exc: BaseException) -> str | None:
        """A reason when `exc` means the store as a whole is unusable, else None."""

    @abstractmethod
    def _is_timeout(self, exc: BaseException) -> bool: ...

    def _is_full(self, exc: BaseException) -> bool:
        return False

    # -- health

    def healthy(self) -> tuple[bool, str]:
        reason = self._unhealthy
        return (not reason, reason)

    def _set_unhealthy(self, reason: str) -> None:
        with self._health_lock:
            if not self._unhealthy:
                log.warning("shared tier %s unhealthy: %s", self.url, reason)
            self._unhealthy = reason

    def _set_healthy(self) -> None:
        with self._health_lock:
            if self._unhealthy:
                log.info("shared tier %s healthy again (was: %s)", self.url, self._unhealthy)
            self._unhealthy = ""

    def _read_stalled(self, fut: Future[ChunkRecord | IntegrityError | None]) -> None:
        with self._health_lock:
            self._stalled += 1
        if self.metrics is not None:
            self.metrics.tier_errors[("shared", "timeout")].inc()
        self._set_unhealthy(self._stall_reason())

        def returned(_: Future[ChunkRecord | IntegrityError | None]) -> None:
            with self._health_lock:
                self._stalled -= 1
        fut.add_done_callback(returned)

    def _stall_reason(self) -> str:
        return (f"{self.scheme} reads stalled: {self._stalled} not answered within "
                f"{self.request_timeout:g}s")

    def _check_available(self) -> None:
        reason = self._unhealthy
        if reason:
            raise SharedTierUnavailable(f"shared tier unhealthy: {reason}")

    def probe(self) -> tuple[bool, str]:
        """Ask the store whether it answers (call every second or so from a thread).

        Runs the probe in the tier's pool and waits at most the request timeout,
        so a hung mount or a black-holed endpoint cannot stall the caller.
        """
        try:
            fut = self._pool.submit(self._store_probe)
        except RuntimeError:  # closed: a late tick of the caller's probe thread
            return self.healthy()
        try:
            fut.result(timeout=self.request_timeout)
        except TimeoutError:
            self._set_unhealthy(f"{self.scheme} unreachable: no answer within "
                                f"{self.request_timeout:g}s")
        except Exception as e:  # any failure of the store means "not serving"
            self._set_unhealthy(self._outage(e) or f"{self.scheme} error: {e}")
        else:
            if self._stalled:  # it answers a probe, but reads still hang in it
                self._set_unhealthy(self._stall_reason())
            else:
                self._set_healthy()
        return self.healthy()

    # -- one store request: fail fast, measure, classify failures

    def _request(self, op: str, kind: str, fn: Callable[[], T]) -> T:
        self._check_available()
        m = _Op(self.metrics, op)
        try:
            result = fn()
        except Exception as e:
            m.done(False)
            raise self._failed(kind, e) from e
        m.done(True)
        return result

    def _failed(self, kind: str, exc: Exception) -> OSError:
        """Count a failed request, update health, and give the caller an OSError."""
        if self._is_timeout(exc):
            kind = "timeout"
        elif self._is_full(exc):
            kind = "full"
        if self.metrics is not None:
            self.metrics.tier_errors[("shared", kind)].inc()
        reason = self._outage(exc)
        if reason:
            self._set_unhealthy(reason)
        if isinstance(exc, OSError):
            return exc
        return SharedStoreError(f"{self.scheme} {kind} failed: {exc}")

    # -- ChunkTier

    @property
    def capacity_bytes(self) -> int:
        return 0  # a bucket or a shared mount has no capacity the agent manages

    @property
    def used_bytes(self) -> int:
        """Bytes of chunk objects at the last `refresh_usage()` (best effort)."""
        return self._usage[1]

    @property
    def chunks(self) -> int:
        """Chunk objects at the last `refresh_usage()` (best effort)."""
        return self._usage[0]

    def refresh_usage(self) -> tuple[int, int]:
        """List the store once to update `chunks` and `used_bytes` (a full listing: rare)."""
        n = size = 0
        for obj in self.list_objects():
            if obj.key is not None:
                n, size = n + 1, size + obj.size
        self._usage = (n, size)
        return self._usage

    def contains(self, key: bytes) -> bool:
        found = self._request("head", "read", lambda: self._store_head(key))
        if not found:
            self._remember_absent(key)
        return found

    def read(self, key: bytes) -> ChunkRecord | None:
        """Runs in the tier's own read threads and waits at most the request timeout: a
        read that outlives it turns the tier unhealthy (reads stalled) until it returns."""
        self._check_available()
        try:
            fut = self._reads.submit(self._request, "get", "read",
                                     lambda: self._store_read(key))
        except (PoolFull, RuntimeError) as e:  # RuntimeError: closed
            raise SharedStoreError(f"{self.scheme} read of {key.hex()} refused: {e}") from e
        try:
            got = fut.result(timeout=self.request_timeout)
        except TimeoutError:
            self._read_stalled(fut)
            raise OSError(errno.ETIMEDOUT, f"{self.scheme} read of {key.hex()} not answered "
                          f"within {self.request_timeout:g}s") from None
        if got is None:
            self._remember_absent(key)
            return None
        if isinstance(got, IntegrityError):
            self._bad_object(key, got)
            raise got
        return got

    def write(self, rec: ChunkRecord) -> None:
        self._request("put", "write", lambda: self._store_put(rec))
        with self._absent_lock:
            self._absent.pop(rec.key, None)

    def delete(self, key: bytes) -> bool:
        return self._request("delete", "delete", lambda: self._store_delete(key))

    def keys(self) -> Iterable[bytes]:
        return [o.key for o in self.list_objects() if o.key is not None]

    def close(self) -> None:
        """Bounded: calls stuck in the store are abandoned (daemon threads)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._reads.shutdown(wait=False, cancel_futures=True)

    # -- listing and bulk delete (gc)

    def list_objects(self) -> Iterator[ObjectInfo]:
        """Every chunk object (and leftover of an interrupted write) under the URL."""
        self._check_available()
        m = _Op(self.metrics, "list")
        try:
            yield from self._store_list()
        except Exception as e:
            m.done(False)
            raise self._failed("read", e) from e
        m.done(True)

    def remove_objects(self, objs: Sequence[ObjectInfo]) -> int:
        """Delete listed objects in one go where the store allows; returns failures."""
        if not objs:
            return 0
        return self._request("delete", "delete", lambda: self._store_remove(objs))

    # -- presence checks for LOOKUP

    def contains_many(self, keys: Sequence[bytes],
                      budget_s: float | None = None) -> dict[bytes, bool | None]:
        """Presence of each key, answered within `budget_s` (default: the lookup budget).

        True/False when known in time, None when unknown (the store is unhealthy
        or did not answer in time): a caller treats None as a miss. Keys seen
        absent in the last `negativeCacheTtl` seconds are answered from memory.
        Checks still running at the deadline finish in the background and feed
        the negative cache, so a repeated LOOKUP gets its answer.
        """
        result: dict[bytes, bool | None] = dict.fromkeys(keys)
        if self._unhealthy or not keys:
            return result
        budget = self.lookup_budget if budget_s is None else budget_s
        deadline = time.monotonic() + budget
        todo = self._not_known_absent(keys, result)
        found: dict[bytes, bool] = {}
        futs: list[Future[None]] = []
        step = max(1, self.presence_batch)
        try:
            for i in range(0, len(todo), step):
                batch = todo[i : i + step]
                futs.append(self._pool.submit(self._check_batch, batch, found))
        except RuntimeError:  # closed while a LOOKUP was in progress: unknown
            pass
        if futs:
            _, pending = wait(futs, timeout=max(0.0, deadline - time.monotonic()))
            for f in pending:
                f.cancel()  # not started yet: nobody is waiting for it any more
        # `found` is written by pool threads; a copy taken under the GIL is consistent
        for key, present in dict(found).items():
            result[key] = present
        return result

    def _not_known_absent(self, keys: Sequence[bytes],
                          result: dict[bytes, bool | None]) -> list[bytes]:
        now = time.monotonic()
        todo: list[bytes] = []
        with self._absent_lock:
            for key in dict.fromkeys(keys):  # once per distinct key, in order
                until = self._absent.get(key)
                if until is not None and until > now:
                    result[key] = False
                else:
                    todo.append(key)
        return todo

    def _check_batch(self, batch: Sequence[bytes], found: dict[bytes, bool]) -> None:
        for key in batch:
            if self._unhealthy:
                return  # the store failed meanwhile: don't queue more requests on it
            try:
                found[key] = self.contains(key)
            except OSError:
                return  # counted and classified by _request; unknown is the answer

    def _remember_absent(self, key: bytes) -> None:
        until = time.monotonic() + self.negative_cache_ttl
        with self._absent_lock:
            if len(self._absent) >= _NEGATIVE_CACHE_MAX:
                now = time.monotonic()
                self._absent = {k: t for k, t in self._absent.items() if t > now}
                if len(self._absent) >= _NEGATIVE_CACHE_MAX:
                    self._absent.clear()
            self._absent[key] = until

    # -- integrity

    def _bad_object(self, key: bytes, err: IntegrityError) -> None:
        """Count a corrupt object and delete it, so no node reads it again.

        Deleting (not quarantining, as G3 does) because a quarantine on a shared
        store has no owner to look at it or clean it; the log line keeps the
        evidence. A node may rewrite a good copy later: the key is content-addressed.
        """
        log.error("shared tier %s: %s; deleting the object", self.url, err)
        if self.metrics is not None:
            self.metrics.integrity_failures["shared"].inc()
        try:
            self._request("delete", "delete", lambda: self._store_delete(key))
        except OSError as e:
            log.error("cannot delete corrupt object %s: %s", key.hex(), e)
        self._remember_absent(key)

