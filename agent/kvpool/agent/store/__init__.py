"""The chunk store: what every socket op does across the agent's tiers (see chunkstore.py),
in parts that own their state."""

from __future__ import annotations

from ..constants import TIER_CODES as TIER_CODE
from .chunkstore import (
    MAX_LEASES_PER_CLIENT,
    WAIT,
    ChunkStore,
    CommitRequest,
    Granted,
    Storing,
    open_journal,
)
from .demotion import IO_THREADS, Demotion
from .errors import OpError, check_key
from .loads import READ_THREADS, Loaded, Loads
from .readahead import ReadAhead
from .sharedlink import PRESENCE_WAIT_THREADS, SharedLink
from .snapshot import LookupCounts, StoreSnapshot, TierSnapshot, samples, stats_reply

__all__ = [
    "IO_THREADS", "MAX_LEASES_PER_CLIENT", "PRESENCE_WAIT_THREADS", "READ_THREADS", "TIER_CODE",
    "WAIT", "ChunkStore", "CommitRequest", "Demotion", "Granted", "Loaded", "Loads",
    "LookupCounts", "OpError", "ReadAhead", "SharedLink", "StoreSnapshot", "Storing",
    "TierSnapshot", "check_key", "open_journal", "samples", "stats_reply",
]
