"""The `file://` store's marker and id, and the agent's record of the stores it has used.

Real directories and files; the tier classes as the agent opens them (no agent process:
tests/shared/test_empty_mount.py runs real agents on a real bind mount).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvpool.agent.config import SharedTier
from kvpool.agent.gc import run_gc
from kvpool.agent.seenstores import SeenStores
from kvpool.agent.tiers.sharedfs import STORE_MARKER, FileSharedTier, init_store, read_marker

from .conftest import make_chunk


def tier_on(root: Path, seen: SeenStores | None = None, *,
            initialise: bool = True) -> FileSharedTier:
    return FileSharedTier(SharedTier(url=root.as_uri(), request_timeout=5.0), seen=seen,
                          initialise=initialise)


def test_a_new_store_gets_an_id_that_every_later_opening_finds(tmp_path: Path) -> None:
    first = tier_on(tmp_path / "store")
    second = tier_on(tmp_path / "store")
    try:
        assert first.store_id and len(first.store_id) == 32
        assert second.store_id == first.store_id == read_marker(tmp_path / "store" / STORE_MARKER)
        assert [p.name for p in (tmp_path / "store").iterdir()] == [STORE_MARKER]  # no leftover
    finally:
        first.close()
        second.close()


def test_the_record_outlives_the_agent_and_a_store_it_names_is_never_made_anew(
        tmp_path: Path) -> None:
    root, record = tmp_path / "store", tmp_path / "agent.stores"
    tier = tier_on(root, SeenStores(record))
    store_id = tier.store_id
    tier.close()
    assert SeenStores(record).id_of(root.as_uri()) == store_id  # a new process reads it back

    (root / STORE_MARKER).unlink()  # an empty mount point in the store's place
    again = tier_on(root, SeenStores(record))
    try:
        healthy, reason = again.healthy()
        assert not healthy and "the mount looks absent" in reason and str(store_id) in reason
        assert not (root / STORE_MARKER).exists()
        with pytest.raises(OSError):
            again.write(make_chunk(1))
        assert not any(root.iterdir())
    finally:
        again.close()


def test_a_seen_store_whose_directory_is_gone_is_not_made_again(tmp_path: Path) -> None:
    root, record = tmp_path / "mnt" / "store", tmp_path / "agent.stores"
    tier_on(root, SeenStores(record)).close()
    (root / STORE_MARKER).unlink()
    root.rmdir()  # the URL's directory lay on the file system that is gone
    tier = tier_on(root, SeenStores(record))
    try:
        healthy, reason = tier.healthy()
        assert not healthy and "directory missing" in reason, reason
        assert not root.exists()
    finally:
        tier.close()


def test_a_marker_from_before_ids_is_a_store_with_the_empty_id(tmp_path: Path) -> None:
    root, record = tmp_path / "store", tmp_path / "agent.stores"
    root.mkdir()
    (root / STORE_MARKER).write_bytes(b"A kvpool shared chunk store. Do not delete.\n")
    tier = tier_on(root, SeenStores(record))
    tier.close()
    assert tier.store_id == "" and SeenStores(record).id_of(root.as_uri()) == ""
    assert init_store(root) == ("", False)  # it is a store: left as it is


def test_init_store_marks_only_an_existing_directory_and_only_once(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        init_store(tmp_path / "nowhere")
    assert not (tmp_path / "nowhere").exists()
    store_id, created = init_store(tmp_path)
    assert created and read_marker(tmp_path / STORE_MARKER) == store_id
    assert init_store(tmp_path) == (store_id, False)


def test_gc_neither_marks_a_root_nor_makes_a_tenants_directory(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    result = run_gc(root.as_uri(), all_objects=True, tenants=["chat"])
    assert result.deleted == 0
    assert not any(root.iterdir())  # an empty mount point stays empty
    assert not (root / "tenants").exists()


def test_a_damaged_record_is_named_and_forgets_only_what_it_held(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    record = tmp_path / "agent.stores"
    record.write_text("{not json")
    with caplog.at_level(logging.ERROR):
        seen = SeenStores(record)
    assert seen.id_of("file:///mnt/store") is None
    assert f"ignoring the record of shared stores {record}, which is damaged" in caplog.text
    seen.remember("file:///mnt/store", "abc")  # written whole again
    assert SeenStores(record).id_of("file:///mnt/store") == "abc"


def test_a_record_that_cannot_be_written_leaves_the_store_usable(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    record = tmp_path / "gone" / "agent.stores"  # its directory does not exist
    with caplog.at_level(logging.ERROR):
        tier = tier_on(tmp_path / "store", SeenStores(record))
    try:
        assert tier.healthy() == (True, "")
        assert "could not record shared store" in caplog.text
    finally:
        tier.close()


def test_a_record_kept_in_two_places_is_read_from_either(tmp_path: Path) -> None:
    tmpfs, disk = tmp_path / "agent.stores", tmp_path / "nvme.stores"
    SeenStores(tmpfs, disk).remember("file:///mnt/store", "abc")
    tmpfs.unlink()  # a reboot empties the tmpfs; the disk keeps its copy
    assert SeenStores(tmpfs, disk).id_of("file:///mnt/store") == "abc"
    SeenStores(tmpfs).remember("file:///mnt/store", "def")  # the copies differ
    assert SeenStores(tmpfs, disk).id_of("file:///mnt/store") == "def"  # the first one wins


def test_a_copy_that_lacks_the_store_gets_it_when_the_store_is_next_seen(
        tmp_path: Path) -> None:
    """An agent that has used its store is given a state directory (an upgrade): its new
    copy of the record gets the store when the agent next sees the marker, not only when
    the id changes, or a reboot would find that copy empty."""
    root, tmpfs, disk = tmp_path / "store", tmp_path / "agent.stores", tmp_path / "state.json"
    tier_on(root, SeenStores(tmpfs)).close()  # the store used before there was a copy
    store_id = SeenStores(tmpfs).id_of(root.as_uri())
    tier_on(root, SeenStores(tmpfs, disk)).close()  # restarted with the copy: the same id
    assert store_id and SeenStores(disk).id_of(root.as_uri()) == store_id


def test_a_store_marked_afresh_is_taken_up_at_start_and_recorded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root, record = tmp_path / "store", tmp_path / "agent.stores"
    tier_on(root, SeenStores(record)).close()
    old_id = SeenStores(record).id_of(root.as_uri())
    (root / STORE_MARKER).unlink()
    new_id, created = init_store(root)  # `kvpool gc --init-store` after a wipe
    assert created and new_id != old_id
    with caplog.at_level(logging.WARNING):
        tier = tier_on(root, SeenStores(record))
    try:
        assert tier.healthy() == (True, "") and tier.store_id == new_id
        assert f"the store is a new one (id {new_id}; this agent used id {old_id})" in caplog.text
        assert SeenStores(record).id_of(root.as_uri()) == new_id
    finally:
        tier.close()
