"""Retention of the shared tier: delete expired objects, or every object of a pool.

An object's age is the time since it was last written (S3 `LastModified`, a
file's mtime): object stores keep no access time, and a mount's atime is
usually off (`noatime`). A chunk that is written again (another node demotes
the same key) starts a new life, so a prefix in use by any node stays young.

`kvpool gc --shared URL --ttl 7d` collects expired chunks;
`kvpool gc --shared URL --all` empties the pool's prefix, which the operator
runs as a Job when a pool with `reclaimPolicy: Delete` is removed. Only
objects in kvpool's layout are touched: anything else under the prefix is
left alone.

A `file://` store's marker is not an object: gc keeps it, so an emptied store is still
the store its running agents use, not an absent mount. gc never writes a marker either
(a root gc found unmarked may be an empty mount point): `kvpool gc --init-store` does,
explicitly (`init_stores`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .config import SharedTier, tenant_url
from .tiers.factory import open_shared_tier
from .tiers.shared import ObjectInfo, SharedChunkTier
from .tiers.sharedfs import init_store, root_of
from .units import parse_duration

if TYPE_CHECKING:
    from .metrics import AgentMetrics

BATCH = 1000
"""Objects per delete request (the S3 DeleteObjects limit)."""
LEFTOVER_GRACE = 3600.0
"""A temporary file this young may be an upload in progress: a TTL run keeps it."""


@dataclass(slots=True)
class GcResult:
    deleted: int = 0
    kept: int = 0
    bytes_freed: int = 0
    errors: int = 0

    def to_json(self) -> dict[str, int]:
        return asdict(self)


def collect(tier: SharedChunkTier, ttl_seconds: float | None, all_objects: bool = False, *,
            now: float | None = None, metrics: AgentMetrics | None = None) -> GcResult:
    """Delete objects older than `ttl_seconds` (or all of them); returns the counts.

    `now` (seconds since the epoch) is the reference for ages; tests inject it.
    Raises OSError when the store cannot be listed.
    """
    if all_objects == (ttl_seconds is not None):
        raise ValueError("give exactly one of a TTL or all_objects=True")
    now = time.time() if now is None else now
    result = GcResult()
    batch: list[ObjectInfo] = []
    for obj in tier.list_objects():
        if all_objects or _expired(obj, now, ttl_seconds):
            batch.append(obj)
            if len(batch) >= BATCH:
                _remove(tier, batch, result, metrics)
                batch = []
        else:
            result.kept += 1
    _remove(tier, batch, result, metrics)
    return result


def _expired(obj: ObjectInfo, now: float, ttl: float | None) -> bool:
    assert ttl is not None
    limit = ttl if obj.key is not None else max(ttl, LEFTOVER_GRACE)
    return now - obj.last_modified > limit


def _remove(tier: SharedChunkTier, batch: list[ObjectInfo], result: GcResult,
            metrics: AgentMetrics | None) -> None:
    if not batch:
        return
    try:
        failed = tier.remove_objects(batch)
    except OSError:
        failed = len(batch)
    done = len(batch) - failed
    result.errors += failed
    result.deleted += done
    # Which objects of a failed batch survived is not known: count freed bytes
    # only for fully successful batches, so the figure never overstates.
    if failed == 0:
        result.bytes_freed += sum(o.size for o in batch)
    if metrics is not None and done:
        metrics.evictions[("shared", "ttl")].inc(done)


def run_gc(url: str, ttl: float | str | None = None, all_objects: bool = False,
           endpoint_url: str | None = None, *, region: str | None = None,
           credentials_file: Path | None = None, addressing_style: str = "auto",
           tenants: Sequence[str] = ()) -> GcResult:
    """`kvpool gc --shared URL [--ttl 7d | --all] [--tenant NAME ...]` without the CLI.

    `ttl` is seconds or a duration string (`7d`, `12h`). `tenants` adds each tenant's
    prefix (`<url>/tenants/<name>`) to the pool's. Credentials and region come from
    the AWS environment unless given. Raises ValueError on bad arguments and OSError
    when the store cannot be reached.
    """
    ttl_s = parse_duration(ttl) if ttl is not None else None
    total = GcResult()
    for prefix in [url, *(tenant_url(url, t) for t in tenants)]:
        cfg = SharedTier.model_validate({
            "url": prefix, "endpoint_url": endpoint_url, "region": region,
            "credentials_file": credentials_file, "addressing_style": addressing_style})
        if prefix != url and prefix.startswith("file://") and not root_of(prefix).is_dir():
            continue  # a tenant that never stored anything here (gc never makes its directory)
        tier = open_shared_tier(cfg, initialise=False)
        try:
            result = collect(tier, ttl_s, all_objects)
        finally:
            tier.close()
        for name, value in result.to_json().items():
            setattr(total, name, getattr(total, name) + value)
    return total



@dataclass(frozen=True, slots=True)
class StoreMark:
    url: str
    id: str
    created: bool
    """True: this run marked the store; False: it was marked already."""


def init_stores(url: str, tenants: Sequence[str] = ()) -> list[StoreMark]:
    """`kvpool gc --shared file:///... --init-store`: mark the root of the pool's store (and
    of each tenant's) as a kvpool store where it has no marker yet.

    Raises ValueError for a URL that is not `file://` (an S3 prefix has no marker) and
    OSError when a root is not an existing directory or cannot be written.
    """
    if not url.startswith("file://"):
        raise ValueError(f"{url!r}: only a file:// store has a marker to initialise")
    marks = []
    for prefix in [url, *(tenant_url(url, t) for t in tenants)]:
        root = root_of(prefix)
        if prefix != url:  # below the pool's root, checked (and marked) first
            root.mkdir(parents=True, exist_ok=True)
        store_id, created = init_store(root)
        marks.append(StoreMark(prefix, store_id, created))
    return marks
