"""The shared stores an agent has used: its record, on the node, of each `file://` store's id.

A `file://` store marks its root with a marker that holds the store's id (`tiers.sharedfs`).
A root without the marker is either a store not initialised yet or an unmounted file
system's empty mount point. A running agent tells them apart by having seen the marker;
this record lets an agent that *starts* tell them apart too: a URL it has used a store at
is never a new store, so a root found there without a marker is the mount gone.

The record lives beside the DRAM arena and its journal (`AgentConfig.stores_path`), with
their lifetime: on the host's tmpfs it outlives agent restarts and upgrades, not a reboot
of the node; `kvpool cleanup` removes it with them. An agent with an NVMe tier or a state
directory keeps a copy in each (`AgentConfig.stores_paths`), on disk, which outlives a
reboot too: a node that boots with its network file system not mounted is the likeliest
way to start an agent on an empty mount point.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from . import atomicfile

log = logging.getLogger(__name__)

_VERSION = 1


class SeenStores:
    """{store URL: store id} of the stores this agent has used, kept in small files: the
    same record in each of `paths` (the first one's id wins where they differ)."""

    def __init__(self, *paths: Path) -> None:
        self.paths = paths
        self._lock = threading.Lock()  # the tier's probe thread may adopt a store
        self._ids: dict[str, str] = {}
        loaded = [_load(path) for path in paths]
        for ids in reversed(loaded):
            self._ids.update(ids)
        self._behind = any(ids != self._ids for ids in loaded)
        """A copy lacks or differs from the record: the next `remember` writes every copy
        (a state directory given to an agent that has used its store, a tmpfs emptied by a
        reboot), even when the id it remembers is the one already known."""

    def id_of(self, url: str) -> str | None:
        """The id of the store this agent last used at `url`; None: it never used one."""
        with self._lock:
            return self._ids.get(url)

    def remember(self, url: str, store_id: str) -> None:
        """Record that this agent uses store `store_id` at `url` (written only on a change,
        or where a copy is behind).

        A failed write is logged, not raised: the store is still usable, only a restart of
        the agent could then not tell its absent mount from a new store.
        """
        with self._lock:
            if self._ids.get(url) == store_id and not self._behind:
                return
            ids = {**self._ids, url: store_id}
            for path in self.paths:
                try:
                    _save(path, ids)
                except OSError as e:
                    log.error("could not record shared store %s (id %s) in %s: %s; a restart "
                              "of the agent could take its absent mount for a new store",
                              url, store_id or "from before ids", path, e)
            self._ids = ids
            self._behind = False  # a copy that failed is not retried: its error was logged


def _load(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.error("could not read the record of shared stores %s: %s", path, e)
        return {}
    try:
        doc = json.loads(text)
        stores = doc["stores"]
        if doc.get("version") != _VERSION or not isinstance(stores, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in stores.items()):
            raise ValueError(f"not a version {_VERSION} record")
    except (ValueError, KeyError, TypeError) as e:
        # Written whole (a temporary file renamed into place), so this is not a torn write:
        # someone else's file. Starting without it only forgets the stores it names.
        log.error("ignoring the record of shared stores %s, which is damaged (%s): an "
                  "absent mount of a store it named would be taken for a new store", path, e)
        return {}
    return dict(stores)


def _save(path: Path, ids: dict[str, str]) -> None:
    """Replace the file whole: a reader (the next start) sees the old record or the new."""
    text = json.dumps({"version": _VERSION, "stores": ids}, indent=1, sort_keys=True) + "\n"
    # Synced, file and directory: the copy on disk must outlive a reboot (a node that boots
    # without its network mount is the case this record is for).
    atomicfile.replace(path, [text.encode()], tmp=path.with_name(f"{path.name}.tmp"))
