"""Peer reads' results handed from worker threads to the event loop (`peers.settle`)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable

import pytest

from kvpool.agent.peers.settle import Settler


def test_results_settled_from_threads_reach_the_loop_and_a_burst_takes_one_wake_up() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        settler: Settler[int] = Settler(loop)
        futs = [loop.create_future() for _ in range(64)]
        # Settled from other threads while the loop is busy: one wake-up drains them all.
        threads = [threading.Thread(target=settler.settle, args=(f, i))
                   for i, f in enumerate(futs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert settler.wakes == 1
        assert [await f for f in futs] == list(range(64))
        assert settler.wakes == 1
        # A future already settled is left as it is.
        done = loop.create_future()
        done.set_result(-1)
        settler.settle(done, 5)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert done.result() == -1
        # Closed (the agent stopping): what is queued is resolved, and a later result
        # still reaches its future.
        queued, later = loop.create_future(), loop.create_future()
        settler.settle(queued, 1)
        settler.close()
        assert queued.result() == 1
        threading.Thread(target=settler.settle, args=(later, 2)).start()
        assert await asyncio.wait_for(later, 10) == 2

    asyncio.run(main())


def test_a_deferred_wake_up_waits_for_its_payer_and_keeps_the_eventfd_open_until_paid(
) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        settler: Settler[int] = Settler(loop)
        fut = loop.create_future()
        # A worker settles with the wake-up deferred (its next compiled call makes it).
        owes = await loop.run_in_executor(None, lambda: settler.settle(fut, 1, defer=True))
        assert owes
        for _ in range(20):  # nothing woke the loop: the result waits for the wake-up
            await asyncio.sleep(0)
        assert not fut.done()
        os.eventfd_write(settler.owed_fd, 1)  # what the compiled call writes, first thing
        settler.paid()
        assert await asyncio.wait_for(fut, 10) == 1
        # Closed while a wake-up is owed: the eventfd stays open for the write to come, and
        # closes once it is paid.
        queued = loop.create_future()
        assert settler.settle(queued, 2, defer=True)
        fd = settler.owed_fd
        settler.close()
        assert queued.result() == 2
        os.fstat(fd)
        settler.pay()
        with pytest.raises(OSError):
            os.fstat(fd)

    asyncio.run(main())


def test_a_callback_target_is_called_on_the_loop_once_and_one_that_raises_spares_the_rest(
) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        errors: list[BaseException] = []
        loop.set_exception_handler(lambda _, ctx: errors.append(ctx["exception"]))
        settler: Settler[int] = Settler(loop)
        got: list[tuple[int, int]] = []
        ident = threading.get_ident()

        def call(i: int) -> Callable[[int], None]:
            def on(result: int) -> None:
                assert threading.get_ident() == ident  # the loop's thread
                got.append((i, result))
                if i == 1:
                    raise ValueError("a bug in one read's callback")
            return on
        threads = [threading.Thread(target=settler.settle, args=(call(i), 10 * i))
                   for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Never inline, from the loop's thread too: queued, called as the loop drains.
        settler.settle(call(3), 30)
        assert not got
        for _ in range(5):
            await asyncio.sleep(0)
        assert sorted(got) == [(0, 0), (1, 10), (2, 20), (3, 30)]
        assert [str(e) for e in errors] == ["a bug in one read's callback"]
        settler.close()

    asyncio.run(main())
