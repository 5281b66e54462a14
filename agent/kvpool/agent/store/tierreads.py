"""Verified reads of one chunk from below DRAM, in a worker thread: a failure is a miss."""

from __future__ import annotations

import logging

from ..metrics import AgentMetrics
from ..tiers.base import ChunkRecord, IntegrityError
from ..tiers.nvme import NvmeTier
from ..tiers.shared import SharedChunkTier

log = logging.getLogger(__name__)


def read_nvme(nvme: NvmeTier, key: bytes, m: AgentMetrics, *,
              indexed: bool = True) -> ChunkRecord | None:
    """A verified chunk from its NVMe file; a failure is counted and is a miss.
    `indexed=False` reads a chunk already taken out of the index (on its way to G4)."""
    try:
        rec = nvme.read(key) if indexed else nvme.read_file(key)
    except IntegrityError as e:
        log.error("integrity failure in nvme: %s; chunk quarantined, not served or moved", e)
        m.integrity_failures["nvme"].inc()
        return None
    except OSError as e:
        log.error("nvme read of %s failed: %s", key.hex(), e)
        m.tier_errors[("nvme", "read")].inc()
        return None
    if rec is not None:
        m.read_bytes["nvme"].inc(rec.size)
    return rec


def read_shared(shared: SharedChunkTier, key: bytes,
                m: AgentMetrics) -> tuple[ChunkRecord | None, bool]:
    """A verified chunk from G4, or None: a failure is a miss (the tier counts and logs
    it); and whether the store was found to hold no good copy (absent, or corrupt and
    deleted), as opposed to not answering."""
    try:
        rec = shared.read(key)
    except IntegrityError:
        return None, True  # counted, logged and deleted by the tier
    except OSError as e:
        log.warning("shared read of %s failed: %s", key.hex(), e)
        return None, False
    if rec is None:
        return None, True
    m.read_bytes["shared"].inc(rec.size)
    return rec, False
