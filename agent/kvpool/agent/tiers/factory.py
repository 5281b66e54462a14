"""The shared-tier factory: which backend serves a shared tier's URL.

It sits above the backends (`s3`, `sharedfs`) and their common base (`shared`),
so no backend imports another or the factory. A backend is imported only when a
URL asks for it: an agent on a file:// tier never imports boto3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .shared import SharedChunkTier

if TYPE_CHECKING:
    from ..config import SharedTier
    from ..metrics import AgentMetrics
    from ..seenstores import SeenStores


def open_shared_tier(cfg: SharedTier, metrics: AgentMetrics | None = None, *,
                     seen: SeenStores | None = None, initialise: bool = True
                     ) -> SharedChunkTier:
    """The shared tier for `cfg.url`: `s3://bucket/prefix` or `file:///path`.

    For `file://`: `seen` is the agent's record of the stores it has used, and
    `initialise` whether a root without a store marker is made a new store (see
    `FileSharedTier`); an S3 prefix needs neither."""
    if cfg.url.startswith("s3://"):
        from .s3 import S3SharedTier

        return S3SharedTier(cfg, metrics)
    if cfg.url.startswith("file://"):
        from .sharedfs import FileSharedTier

        return FileSharedTier(cfg, metrics, seen=seen, initialise=initialise)
    raise ValueError(f"{cfg.url!r}: the shared tier URL must start with s3:// or file://")
