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
from typing import Any

import torch
from xxhash import xxh3_64_intdigest

from ... import leasekernel, wsumkernel
from ...client import KVPoolClient
from ...hostcopy import HostBlocks
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
        self._lock = threading.Lock()
        """Guards the state below: entered in C (`with`), where a `Condition`'s own
        `__enter__` is a Python call."""
        self._cond = threading.Condition(self._lock)
        self._idle = False
        """A step that computed nothing waits for a load (`finished`): its wake-up is a
        token on `_woken`, which the load's report puts (one C call, where a `Condition`'s
        `notify_all` is several Python calls: ~30 µs of a load's own time, cold)."""
        self._woken: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._saves: collections.Counter[str] = collections.Counter()
        self._held: set[str] = set()
        self._loaded: set[str] = set()
        self._bad_blocks: set[int] = set()
        self._loading = 0
        """Loads queued or running."""
        self._thread: threading.Thread | None = None
        self._stream: Any = None
        self._host: HostBlocks | None = None
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
        self._host = host_blocks(layers, self._per_block, num_blocks,
                                 self.layout.blocks_per_chunk, self._meta, self._same_meta,
                                 self._meta_hash)
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
        with self._lock:
            wait = self._idle = bool(idle and self._loading and not self._loaded)
        if wait:
            try:
                self._woken.get(timeout=IDLE_WAIT)  # (a load's report puts it: `_wake`)
            except queue.Empty:
                with self._lock:
                    if self._idle:
                        self._idle = False  # no report meanwhile: none puts a token
                    else:
                        self._woken.get_nowait()  # one did, as the wait ended: not stale
        with self._lock:
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
                    self._report_load(job, [0] * len(job.keys[self.rank]))
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
        read: list[int] | None = None  # what the compiled call read already, if it ran
        if host is not None:
            # Block ids over the KV cache's addresses, known before the read: the client
            # reads a lease-free window in one compiled call that plans the copies from
            # them (and refuses ids outside the cache, nothing read).
            target = host.target(job.block_ids, job.skip_blocks)
            client = self.link.client
            # The usual load (every chunk in DRAM): that call alone, vLLM told before the
            # agent (no other Python between the I/O thread and the call, or after it: ~30
            # µs of a 2k load's own time, cold). Anything else: the load below (which
            # reconnects a dropped link, leases what it must, reports bad blocks), of the
            # chunks that call left only.
            if client is not None:
                read = client.read_blocks(keys, target, lambda: self._report_loaded(job))
                if read is not None and all(read):
                    return
        else:
            chunks = [self._segments(bids, job.skip_blocks if i == 0 else 0)
                      for i, bids in enumerate(job.chunks(self.layout.blocks_per_chunk))]

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
            if host is None:  # (a `BlockTargets` names its metadata itself)
                client.expect_meta(self._meta)
            with client.releases_held():
                sizes = client.get_many_into(keys, target, verify=True, stream=self._stream,
                                             read=read)
                if all(sizes):  # every chunk loaded (the usual load): the fewest steps
                    self._report_loaded(job)
                    reported = True
                    return sizes
                # A chunk still stored but not loadable (its checksum failed: corrupt) is
                # deleted, so that the next request that computes it stores it again; one
                # that is gone costs a DELETE that finds nothing.
                for key, size in zip(keys, sizes, strict=True):
                    if not size and client.delete(key):
                        log.warning("kvpool: a stored chunk failed its checksum and was "
                                    "deleted from the pool")
                self._report_load(job, sizes)
                reported = True
            return sizes
        if self.link.call(get) is None and not reported:
            self._report_load(job, [0] * len(keys))

    def _report_loaded(self, job: LoadJob) -> None:
        """`_report_load` of a load whose every chunk was read."""
        with self._lock:
            self._loaded.add(job.req_id)
            self._loading -= 1
            if self._idle:  # a step waits for it (`finished`): it goes on now
                self._idle = False
                self._woken.put(None)

    def _report_load(self, job: LoadJob, sizes: list[int]) -> None:
        if all(sizes):
            self._report_loaded(job)
            return
        per = self.layout.blocks_per_chunk
        bad = [b for i, (bids, size) in enumerate(zip(job.chunks(per), sizes, strict=True))
               if not size for b in bids[(job.skip_blocks if i == 0 else 0):]]
        if bad and self.link.client is not None:
            missing = sum(1 for s in sizes if not s)
            log.info("kvpool: %d of %d chunks of request %s not loaded (evicted, failing "
                     "their checksum, or of another layout): vLLM recomputes them",
                     missing, len(sizes), job.req_id)
        with self._lock:
            self._bad_blocks.update(bad)
            self._loaded.add(job.req_id)
            self._loading -= 1
            if self._idle:  # a step waits for it (`finished`): it goes on now
                self._idle = False
                self._woken.put(None)

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


def host_blocks(layers: list[torch.Tensor], per_block: int, num_blocks: int, per_chunk: int,
                meta: bytes, same: Callable[[bytes], bool], meta_hash: int) -> HostBlocks | None:
    """The blocks of CPU KV-cache layers as addresses (`HostBlocks`: block b of layer l at
    `layers[l].data_ptr() + b * stride`); None unless every layer is on the CPU with each
    block contiguous and blocks evenly spaced (then a load copies into addresses; else into
    tensor pieces)."""
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
    # Where the bytes of blocks vLLM already holds are read to (and dropped).
    scratch = torch.empty(nbytes, dtype=torch.uint8)
    return HostBlocks([t.data_ptr() for t in layers], stride, nbytes, num_blocks, per_chunk,
                      meta, scratch_address=scratch.data_ptr(), owner=(layers, scratch),
                      same=same, meta_hash=meta_hash)
