"""Shared deletes and uploads of one key land in the order the agent made them.

A delete runs in the store's background pool, an upload in the write-behind queue's
threads. When the pool is busy (demotions, file removals) a delete can run long after it
was asked for: by then the key may have been put again and uploaded. Run then, the delete
would remove an acknowledged chunk's only shared copy. A real `SharedLink` on a real store
(a directory and moto's S3 server), with its background pool held busy by a task that
waits for the test.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvpool.agent.config import TierPolicy
from kvpool.agent.store.sharedlink import SharedLink
from kvpool.agent.tiers.base import ChunkRecord

from .conftest import Backend, make_chunk


@pytest.fixture
def busy_pool() -> Iterator[tuple[ThreadPoolExecutor, threading.Event]]:
    """A one-thread background pool, busy until the returned event is set."""
    pool = ThreadPoolExecutor(1)
    free = threading.Event()
    pool.submit(free.wait, 60)
    yield pool, free
    free.set()
    pool.shutdown(wait=True)


def link_on(backend: Backend, pool: ThreadPoolExecutor) -> SharedLink:
    return SharedLink(backend.open(), backend.config(), backend.metrics, pool, TierPolicy)


def uploaded(link: SharedLink, rec: ChunkRecord) -> None:
    """Put `rec` (a commit's write-through), and wait until its upload has landed."""
    link.upload(rec)
    assert link.uploads is not None and link.uploads.drain(30)


async def deleting(link: SharedLink, key: bytes) -> asyncio.Future[None]:
    """A DELETE of `key`, asked for now; its store delete waits for the background pool."""
    delete = asyncio.ensure_future(link.delete(key))
    await asyncio.sleep(0)
    return delete


def test_a_delete_overtaken_by_a_new_upload_of_its_key_leaves_it_stored(
        backend: Backend, busy_pool: tuple[ThreadPoolExecutor, threading.Event]) -> None:
    pool, free = busy_pool
    link = link_on(backend, pool)
    rec = make_chunk(1)

    async def scenario() -> None:
        uploaded(link, rec)
        delete = await deleting(link, rec.key)
        assert link.deleted(rec.key)
        uploaded(link, rec)  # put again: acknowledged, and uploaded at once
        assert link.tier.contains(rec.key)
        free.set()
        await asyncio.wait_for(delete, 30)

    asyncio.run(scenario())
    assert link.tier.contains(rec.key), "the late delete removed the new upload"
    assert not link.deleted(rec.key)
    link.close()


def test_a_key_deleted_put_and_deleted_again_is_gone(
        backend: Backend, busy_pool: tuple[ThreadPoolExecutor, threading.Event]) -> None:
    pool, free = busy_pool
    link = link_on(backend, pool)
    rec = make_chunk(2)

    async def scenario() -> None:
        uploaded(link, rec)
        first = await deleting(link, rec.key)
        uploaded(link, rec)
        second = await deleting(link, rec.key)
        free.set()
        await asyncio.wait_for(asyncio.gather(first, second), 30)

    asyncio.run(scenario())
    assert not link.tier.contains(rec.key)
    assert not link.deleted(rec.key), "the second delete is not confirmed"
    link.close()
