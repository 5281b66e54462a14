"""What a peer's link delivers, learnt from the batches of reads sent over it: how many
bytes one batch may ask for so that it lands within `peers.timeout`, and whether a read
that timed out was the peer stopping or the link being slow.

Why: the reads of a batch share one deadline, `peers.timeout` from when they are queued,
and a batch took up to `MAX_BATCH_BYTES` (32 MiB): at the default 250 ms that needs a link
of ~1.1 Gb/s for the reads of one connection. Below it a window's tail timed out every
time, and each timeout marked the peer slow (`PeerLink.mark_slow`): on a slow or busy
link the peer tier read nothing for seconds after every window. Sized to the link's
measured speed, a run of peer chunks goes as more, smaller batches, each issued as the one
before it lands (`PeerReads._read_ahead`), each with its own deadline.

Written by the worker threads that receive the batches, read by the event loop as it forms
a batch (a float assignment: no lock).
"""

from __future__ import annotations

import time

MIN_BATCH_BYTES = 8 << 20
"""The smallest a batch is cut to: below it a batch's fixed costs (a round trip, the
holder's turn) show, and a rate measured on a loaded machine (a worker thread waiting for
a core) would shrink batches on a link that is not slow. A link slower than this much in
half of `peers.timeout` (34 MB/s at 250 ms) needs a longer `peers.timeout`."""
TIMEOUT_SHARE = 0.5
"""Of `peers.timeout`, what a batch is sized to take at the measured speed: the rest is
for the next batch of the run sharing the link (it goes out before this one has landed)
and for the measure's noise."""
WEIGHT = 0.5
"""How much each batch's measure moves the estimate (an exponential average: a link that
recovers is followed within a few batches). A batch cut short by its deadline sets it
(`measured`'s `short`)."""


class LinkRate:
    """A link's speed as its batches of reads measured it, and when a reply last came."""

    def __init__(self) -> None:
        self.bytes_per_second: float | None = None
        """None until a batch has landed (its batches are `MIN_BATCH_BYTES` until then)."""
        self.replied_at = 0.0
        """When (monotonic) a reply last arrived whole on any connection to the peer."""

    def replied(self) -> None:
        self.replied_at = time.monotonic()

    def measured(self, nbytes: int, seconds: float, short: bool = False) -> None:
        """`nbytes` of replies received in `seconds` from the batch's write (the bytes of the
        replies that came whole; of a batch that timed out, `short`, those that came
        before). A batch that timed out while replies came moved all the link could: below
        the estimate, the measure replaces it. Averaged in, a link measured at 1 GB/s that
        fell to 25 MB/s kept an estimate 20x too high for four more batches, each of which
        lost its tail."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        was = self.bytes_per_second
        if was is None or (short and rate < was):
            self.bytes_per_second = rate
        else:
            self.bytes_per_second = was + WEIGHT * (rate - was)

    def batch_bytes(self, timeout: float, most: int) -> int:
        """The most chunk bytes one batch should ask for, of at most `most`: what the link
        moves in `TIMEOUT_SHARE` of `timeout`, not under `MIN_BATCH_BYTES`; on a link not
        measured yet, `MIN_BATCH_BYTES`: a first batch sized for a fast link lost its tail
        on a slow one, and on a fast one the next batch is sized to it milliseconds later."""
        floor = min(most, MIN_BATCH_BYTES)
        lands = self._lands(timeout)
        return floor if lands is None else max(floor, min(most, lands))

    def cut(self, timeout: float, most: int) -> bool:
        """Whether the link's measured speed cuts its batches below `most` (`batch_bytes`):
        it is slower than `most` in `TIMEOUT_SHARE` of `timeout`."""
        lands = self._lands(timeout)
        return lands is not None and lands < most

    def _lands(self, timeout: float) -> int | None:
        """Bytes the link moves in `TIMEOUT_SHARE` of `timeout` at its measured speed;
        None before it is measured."""
        rate = self.bytes_per_second
        return None if rate is None else int(rate * timeout * TIMEOUT_SHARE)

    def stalled_since(self, queued: float) -> bool:
        """Whether no reply came from the peer since `queued` (a read's queueing): a read
        that timed out then met a peer that stopped answering (`PeerLink.mark_slow`), not a
        slow link, which kept delivering other replies meanwhile."""
        return self.replied_at < queued
