"""The connector's worker side: copies between vLLM's KV cache and the pool's arena.

One thread of its own per worker does the pool's I/O, in the order the steps asked for it,
so the model's forward never waits on the agent:

- a load copies a request's chunks from the arena straight into the vLLM blocks it was
  given (`get_many_into` with each chunk's segments: one per layer and block), checking each
  chunk's checksum; a chunk that is missing (evicted since the lookup), fails its checksum,
  or has another layout is reported with its blocks (`get_block_ids_with_load_errors`) and
  vLLM recomputes from the first of them. The request is reported loaded either way. A
  chunk that was there but failed its checksum is deleted from the pool, so that the next
  request computing it stores a good copy.
- a save copies newly computed whole chunks from their vLLM blocks into the arena
  (`put_many`), once the step's forward has written them (on CUDA: after an event recorded
  at the end of the step, on a stream of the connector's own).

On CPU a load's destinations are the blocks' addresses (`HostRanges`, consecutive blocks
merged): the client copies a whole window of chunks from the arena in one native call that
verifies each chunk's checksum in the same pass and runs without the GIL
(`kvpool.agent.hostcopy`); the chunks the agent's lookup index describes (DRAM, one extent)
are read without a lease, so a load whose chunks are all in DRAM sends the agent no request
and waits for no answer (docs/protocol.md, "Reads without a lease"). The I/O thread shares
the GIL with vLLM's engine loop, which keeps stepping while a request waits for its KV:
each time the thread lets the GIL go (a torch call, a copy, a socket read) it may wait the
interpreter's switch interval (5 ms) to get it back, so a load is made of as few such
calls as possible. Saves, and every copy
on CUDA, take the client's tensor path (`kvpool.agent.gpu`: on CUDA the arena registered
with CUDA, copies on a side stream, leases released after an event).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable
from itertools import chain, pairwise
from typing import Any

import torch
from xxhash import xxh3_64_intdigest

from ... import leasekernel, wsumkernel
from ...client import KVPoolClient
from ...hostcopy import HostRanges, HostTargets
from .. import engine_pod
from .jobs import LoadJob, Rank, SaveJob, StepJobs
from .layout import chunk_meta, meta_matches
from .link import LOGGER, AgentLink
from .settings import Settings

log = logging.getLogger(LOGGER)
_cuda: Any = torch.cuda
IDLE_WAIT = 0.005
"""Seconds a step that computes nothing waits for a load in flight to finish (`finished`).
vLLM's engine loop steps without pause while its requests wait for their KV: a thread of
Python that takes the GIL from the I/O thread over and over, and a core, for nothing. A
load that finishes meanwhile ends the wait at once; a request that arrives meanwhile is
scheduled at most this much later."""


def pieces(t: torch.Tensor) -> list[torch.Tensor]:
    """`t` as contiguous tensors whose bytes, in order, are `t`'s in logical order."""
    if t.is_contiguous():
        return [t]
    if t.dim() <= 1:
        return [t[i : i + 1] for i in range(t.shape[0])] if t.dim() else [t.reshape(1)]
    return [p for i in range(t.shape[0]) for p in pieces(t[i])]


class WorkerSide:
    def __init__(self, settings: Settings, model: str, rank: Rank) -> None:
        self.settings = settings
        self.layout = settings.layout
        self.rank = rank
        self.link = AgentLink(settings.socket, what=f"worker {rank[0]}/{rank[1]}",
                              name="vllm-worker", timeout=settings.timeout, pod=engine_pod(),
                              model=model, block_size=self.layout.block_size,
                              chunk_tokens=self.layout.chunk_tokens, tenant=self.layout.tenant,
                              lease_free=settings.lease_free)
        self.fault_hook: Callable[[list[bytes]], None] | None = None
        """Called in the I/O thread with a load's keys before it reads the pool: where a
        test injects a fault between the scheduler's lookup and the load."""
        self._layers: list[torch.Tensor] = []
        self._per_block = 1
        self._meta = b""
        self._meta_hash = 0
        self._chunk_bytes = 0
        self._queue: queue.Queue[tuple[LoadJob | SaveJob, Any] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._saves: collections.Counter[str] = collections.Counter()
        self._held: set[str] = set()
        self._loaded: set[str] = set()
        self._bad_blocks: set[int] = set()
        self._loading = 0
        """Loads queued or running."""
        self._thread: threading.Thread | None = None
        self._stream: Any = None
        self._host: _HostBlocks | None = None
        """Where each block of each layer is in host memory, when a load can be copied
        into addresses (CPU tensors whose blocks are contiguous)."""

    # -- set-up

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        layers = list(kv_caches.values())
        first = layers[0]
        if any(t.shape != first.shape or t.dtype != first.dtype for t in layers):
            raise ValueError("kvpool: vLLM's KV cache layers differ in shape or dtype")
        if first.shape[0] % num_blocks:
            raise ValueError(f"kvpool: a KV cache layer of shape {tuple(first.shape)} does not "
                             f"hold {num_blocks} blocks in its first dimension")
        self._layers = layers
        self._per_block = first.shape[0] // num_blocks
        block_shape = [self._per_block, *first.shape[1:]]
        self._meta = chunk_meta(self.layout, block_shape)
        self._meta_hash = xxh3_64_intdigest(self._meta)
        block_bytes = first[: self._per_block].numel() * first.element_size()
        self._chunk_bytes = block_bytes * len(layers) * self.layout.blocks_per_chunk
        self._host = _HostBlocks.of(layers, self._per_block, num_blocks)
        # Compiled now (a fraction of a second, once per process), not in the first load.
        wsumkernel.kernel()
        if self.settings.lease_free:
            leasekernel.kernels()
        self._thread = threading.Thread(target=self._run, name="kvpool-io", daemon=True)
        self._thread.start()

    def _same_meta(self, meta: bytes) -> bool:
        return meta_matches(meta, self._meta)

    def _block(self, layer: torch.Tensor, block_id: int) -> torch.Tensor:
        return layer[block_id * self._per_block : (block_id + 1) * self._per_block]

    def _segments(self, block_ids: list[int], scratch_blocks: int = 0) -> list[torch.Tensor]:
        """A chunk's segments: for each layer, its blocks in order; the first
        `scratch_blocks` blocks go to scratch tensors (their bytes are read past)."""
        out: list[torch.Tensor] = []
        for layer in self._layers:
            for i, b in enumerate(block_ids):
                block = self._block(layer, b)
                out += [torch.empty_like(block)] if i < scratch_blocks else pieces(block)
        return out

    # -- what the model runner calls, on its own thread

    def start_step(self, jobs: StepJobs) -> None:
        """Start this step's loads (`start_load_kv`)."""
        fence = self._fence()
        with self._cond:
            self._held.update(jobs.held)
            self._loading += len(jobs.loads)
        for job in jobs.loads:
            self._queue.put((job, fence))

    def end_step(self, jobs: StepJobs) -> None:
        """Queue this step's saves once its forward is issued (`wait_for_save`)."""
        if not jobs.saves:
            return
        fence = self._fence()
        with self._cond:
            for job in jobs.saves:
                self._saves[job.req_id] += 1
        for job in jobs.saves:
            self._queue.put((job, fence))

    def wait_for_saves(self, req_ids: set[str]) -> None:
        """Until the saves of `req_ids` are done (preempted: their blocks may be reused)."""
        with self._cond:
            self._cond.wait_for(lambda: not any(self._saves[r] for r in req_ids),
                                timeout=4 * self.settings.timeout)

    def finished(self, idle: bool = False) -> tuple[set[str] | None, set[str] | None]:
        """The requests whose saves and whose loads are done. `idle`: this step computed
        nothing, so wait up to `IDLE_WAIT` for a load in flight to finish first."""
        with self._cond:
            if idle and self._loading and not self._loaded:
                self._cond.wait_for(lambda: bool(self._loaded) or not self._loading,
                                    IDLE_WAIT)
            saved = {r for r in self._held if not self._saves[r]}
            self._held -= saved
            for r in saved:
                del self._saves[r]
            loaded, self._loaded = self._loaded, set()
        return saved or None, loaded or None

    def load_errors(self) -> set[int]:
        with self._cond:
            bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def agent_down(self) -> bool:
        return self.link.down_since is not None

    def drain(self, timeout: float) -> bool:
        """Whether every queued job finished within `timeout` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._queue.unfinished_tasks == 0, timeout)

    def close(self) -> None:
        if self._thread is not None:
            self.drain(4 * self.settings.timeout)
            self._queue.put(None)
            self._thread.join(timeout=4 * self.settings.timeout)
            self._thread = None

    def _fence(self) -> Any:
        """On CUDA, an event after what the step issued so far on the compute stream."""
        if not self._layers or self._layers[0].device.type != "cuda":
            return None
        event = _cuda.Event()
        event.record(_cuda.current_stream(self._layers[0].device))
        return event

    # -- the I/O thread

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.link.retry_every)
            except queue.Empty:
                if self.agent_down():
                    self.link.connected()  # is it back? (the scheduler waits for this)
                continue
            if item is None:
                self.link.close()
                return
            job, fence = item
            try:
                if fence is not None:
                    if self._stream is None:
                        self._stream = _cuda.Stream(self._layers[0].device)
                    self._stream.wait_event(fence)
                if isinstance(job, LoadJob):
                    self._load(job)
                else:
                    self._save(job)
            except Exception:  # the I/O thread must outlive any one job
                log.exception("kvpool: %s of request %s failed", type(job).__name__,
                              job.req_id)
                if isinstance(job, LoadJob):
                    self._report_load(job, [0] * len(job.block_ids))
                else:
                    self._report_save(job)
            finally:
                with self._cond:
                    self._queue.task_done()
                    self._cond.notify_all()

    def _load(self, job: LoadJob) -> None:
        keys = job.keys[self.rank]
        if self.fault_hook is not None:
            self.fault_hook(keys)
        host = self._host
        target: Any
        if host is not None:
            # Addresses, known before the read (plain integers: once the ids are checked
            # here, nothing in the read fails on them), so the client reads a lease-free
            # window in compiled calls.
            ranges, starts = host.window(job.block_ids, job.skip_blocks)
            target = HostTargets(self._chunk_bytes, self._meta, ranges, starts,
                                 same=self._same_meta, owner=host, meta_hash=self._meta_hash)
        else:
            chunks = [self._segments(bids, job.skip_blocks if i == 0 else 0)
                      for i, bids in enumerate(job.block_ids)]

            def target(i: int, size: int, meta: bytes) -> Any:
                return chunks[i] if size == self._chunk_bytes and self._same_meta(meta) \
                    else None
        reported = False

        def get(client: KVPoolClient) -> list[int]:
            nonlocal reported
            # vLLM is told the load is done before the leases' RELEASEs go out: that write
            # wakes the agent, which on a busy machine may take this thread's core first.
            # Chunks of this layout are read without a lease where the lookup index allows
            # (the copy checked against the chunk's checksum and the index after it);
            # the rest under a lease, as every chunk on CUDA.
            client.expect_meta(self._meta)
            with client.releases_held():
                sizes = client.get_many_into(keys, target, verify=True, stream=self._stream)
                # A chunk still stored but not loadable (its checksum failed: corrupt) is
                # deleted, so that the next request that computes it stores it again; one
                # that is gone costs a DELETE that finds nothing.
                for key, size in zip(keys, sizes, strict=True) if not all(sizes) else ():
                    if not size and client.delete(key):
                        log.warning("kvpool: a stored chunk failed its checksum and was "
                                    "deleted from the pool")
                self._report_load(job, sizes)
                reported = True
            return sizes
        if self.link.call(get) is None and not reported:
            self._report_load(job, [0] * len(keys))

    def _report_load(self, job: LoadJob, sizes: list[int]) -> None:
        if all(sizes):  # every chunk loaded (the usual load): the fewest steps
            with self._cond:
                self._loaded.add(job.req_id)
                self._loading -= 1
                self._cond.notify_all()
            return
        bad = [b for i, (bids, size) in enumerate(zip(job.block_ids, sizes, strict=True))
               if not size for b in bids[(job.skip_blocks if i == 0 else 0):]]
        if bad and self.link.client is not None:
            missing = sum(1 for s in sizes if not s)
            log.info("kvpool: %d of %d chunks of request %s not loaded (evicted, failing "
                     "their checksum, or of another layout): vLLM recomputes them",
                     missing, len(sizes), job.req_id)
        with self._cond:
            self._bad_blocks.update(bad)
            self._loaded.add(job.req_id)
            self._loading -= 1
            self._cond.notify_all()  # a step waiting for it (`finished`) goes on now

    def _save(self, job: SaveJob) -> None:
        keys = job.keys[self.rank]
        chunks = [self._segments(bids) for bids in job.block_ids]

        def put(client: KVPoolClient) -> list[Any]:
            return client.put_many(keys, chunks, [self._meta] * len(keys),
                                   blocks=job.engine_blocks, stream=self._stream, to=job.to)
        results = self.link.call(put)
        refused = [r for r in results or () if not isinstance(r, bool)]
        if refused:
            log.debug("kvpool: the agent refused %d of %d chunks of request %s: %s",
                      len(refused), len(keys), job.req_id, refused[0])
        self._report_save(job)

    def _report_save(self, job: SaveJob) -> None:
        with self._cond:
            self._saves[job.req_id] -= 1


class _HostBlocks:
    """The blocks of CPU KV-cache layers as addresses: block b of layer l starts at
    `bases[l] + b * stride` and is `nbytes` contiguous bytes."""

    def __init__(self, layers: list[torch.Tensor], bases: list[int], stride: int,
                 nbytes: int, num_blocks: int) -> None:
        self.layers = layers  # the memory the addresses point into, kept alive
        self.bases = bases
        self.stride = stride
        self.nbytes = nbytes
        self.num_blocks = num_blocks
        self.gaps = {b1 - b0 for b0, b1 in pairwise(bases)}
        """How far each layer starts from the previous one: a chunk's last range in a
        layer ends where its first in the next begins only if it spans one of these."""
        self.scratch = torch.empty(nbytes, dtype=torch.uint8)
        """Where the bytes of blocks vLLM already holds are read to (and dropped)."""

    @classmethod
    def of(cls, layers: list[torch.Tensor], per_block: int,
           num_blocks: int) -> _HostBlocks | None:
        """None unless every layer is on the CPU with each block contiguous, blocks evenly
        spaced (then a load copies into addresses; else into tensor pieces)."""
        first = layers[0]
        if first.device.type != "cpu":
            return None
        size = first.element_size()
        stride = first.stride(0) * per_block * size
        nbytes = first[:per_block].numel() * size
        for layer in layers:  # a block is a slice of the first dimension
            if not layer[:per_block].is_contiguous() \
                    or layer.stride(0) * per_block * size != stride or stride < nbytes:
                return None
        return cls(layers, [t.data_ptr() for t in layers], stride, nbytes, num_blocks)

    def check(self, chunks: list[list[int]]) -> None:
        """One clear error for block ids outside the KV cache."""
        for block_ids in chunks:
            if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
                raise ValueError(f"kvpool: block ids {block_ids} out of the KV cache's "
                                 f"{self.num_blocks} blocks")

    def window(self, chunks: list[list[int]], skip_blocks: int) -> tuple[list[int], list[int]]:
        """The destinations of a load's chunks, flat as `HostTargets` takes them: every
        chunk's (address, bytes) pairs one after the other, and where each chunk's begin;
        the first chunk's first `skip_blocks` blocks go to the scratch block. Block ids
        outside the KV cache are refused (`check`)."""
        bases, stride, nbytes, limit = self.bases, self.stride, self.nbytes, self.num_blocks
        ids = list(chain.from_iterable(chunks)) if not skip_blocks else []
        if ids and stride == nbytes and all(chunks) and (
                # the whole load's blocks consecutive (a fresh request's): one comparison
                (ids[0] >= 0 and ids[-1] < limit
                 and ids == list(range(ids[0], ids[0] + len(ids))))
                or (min(ids) >= 0 and max(ids) < limit
                    and all(c == list(range(c[0], c[0] + len(c))) for c in chunks))):
            # the usual load: every chunk consecutive blocks, one range a layer (as `ranges`),
            # in comprehensions (no Python statement per chunk)
            layers = len(bases)
            return ([x for c in chunks for base in bases
                     for x in (base + c[0] * stride, len(c) * nbytes)],
                    list(range(0, layers * len(chunks) + 1, layers)))
        flat: list[int] = []
        starts = [0]
        for i, block_ids in enumerate(chunks):
            n = len(block_ids)
            first = block_ids[0] if n else 0
            if n and (min(block_ids) < 0 or max(block_ids) >= limit):
                self.check([block_ids])
            if n and (i or not skip_blocks) and stride == nbytes \
                    and block_ids[-1] - first == n - 1 \
                    and block_ids == list(range(first, first + n)):
                # the usual chunk: consecutive blocks, one range a layer (as `ranges`)
                at, length = first * stride, n * nbytes
                for base in bases:
                    flat += (base + at, length)
            else:
                for at, length in self.ranges(block_ids, skip_blocks if i == 0 else 0).ranges:
                    flat += (at, length)
            starts.append(len(flat) // 2)
        return flat, starts

    def ranges(self, block_ids: list[int], scratch_blocks: int = 0) -> HostRanges:
        """A chunk's destination: for each layer, its blocks in order (adjacent ones
        merged); the first `scratch_blocks` blocks go to the scratch block. The ids must
        be in the KV cache (`check`)."""
        scratch, stride, nbytes = self.scratch.data_ptr(), self.stride, self.nbytes
        first, n = block_ids[0] if block_ids else 0, len(block_ids)
        if n and not scratch_blocks and stride == nbytes \
                and block_ids == list(range(first, first + n)):
            # the usual chunk: consecutive blocks, one range a layer
            return HostRanges([(base + first * stride, n * nbytes) for base in self.bases],
                              owner=self)
        # The chunk's runs of blocks adjacent in memory, found once for every layer (a
        # block's range follows the previous one's only when the ids are consecutive and
        # blocks are packed), then each layer's ranges from them: a Python step per run
        # and layer, not per block and layer.
        ids = block_ids[scratch_blocks:]
        cuts = [k for k, (a, b) in enumerate(pairwise(ids), 1) if b != a + 1] \
            if stride == nbytes else list(range(1, len(ids)))
        edges = [0, *cuts, len(ids)] if ids else [0]
        offsets = [(ids[s] * stride, (e - s) * nbytes) for s, e in pairwise(edges)]
        lead = [(scratch, nbytes)] * min(scratch_blocks, n)
        bases = self.bases
        if offsets and not lead \
                and offsets[-1][0] + offsets[-1][1] - offsets[0][0] not in self.gaps:
            # no layer's first range follows the previous layer's last in memory
            return HostRanges([(base + o, m) for base in bases for o, m in offsets],
                              owner=self)
        out: list[tuple[int, int]] = []
        for base in bases:
            # Where a range may follow the previous one in memory (a layer's first, the
            # scratch block's), merged as everywhere; within a layer's runs it never does.
            for at, length in lead + [(base + o, m) for o, m in offsets[:1]]:
                if out and out[-1][0] + out[-1][1] == at:
                    out[-1] = (out[-1][0], out[-1][1] + length)
                else:
                    out.append((at, length))
            out += [(base + o, m) for o, m in offsets[1:]]
        return HostRanges(out, owner=self)
