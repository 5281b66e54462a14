"""The connector's scheduler side: which tokens of a request the pool holds, and what the
workers load and save in each step. It never waits on the agent.

- Lookup (`matched_tokens`): the request's whole chunks past vLLM's own prefix hit, counted
  from the agent's shared-memory index (no round trip). Where the index cannot give the
  agent's whole answer (a pool with NVMe or a shared tier, a prefix that leaves DRAM), the
  lookup goes to the socket in a thread of its own and vLLM asks again next step, for at
  most `lookup_wait` seconds; then the request takes what the index holds. Tokens come
  from the pool only in whole chunks and never the prompt's last token (vLLM recomputes
  it to sample the next one).
- Loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS while a worker copies
  its chunks into the blocks vLLM allocated; other requests run meanwhile.
- Saves: each step, the whole chunks a request's computed tokens now cover (prompt and
  output) and the pool did not hold are handed to the workers, with vLLM's block hashes
  for the agent's KV events. A finished request's blocks stay allocated until its saves
  are done (`request_finished` returns True).
- Hand-off (disaggregated prefill): a request whose `kv_transfer_params` name the node
  that will decode it (`PUSH_TO`, set by the router as vLLM's P/D connectors take their
  routing) has its saves pushed there by the agent (docs/integrations.md).
"""

from __future__ import annotations

import array
import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any

from ...client import KVPoolClient
from ...protocol import MAX_LOOKUP_KEYS, EngineBlocks
from .. import engine_pod
from .jobs import LoadJob, Rank, SaveJob, StepJobs
from .layout import KeyChain, engine_hash
from .link import AgentLink
from .settings import Settings

PUSH_TO = "kvpool_push_to"
"""The `kv_transfer_params` key naming the node that will read a request's KV (its decode
engine's node): the agent pushes the request's saved chunks there."""


def push_target(request: Any) -> str | None:
    """The node a request's saves are handed off to, from its `kv_transfer_params`; None
    when it names none (or not as a non-empty string: the save is not held back for it)."""
    params = getattr(request, "kv_transfer_params", None)
    to = params.get(PUSH_TO) if isinstance(params, dict) else None
    return to if isinstance(to, str) and to else None


@dataclass(slots=True)
class _Request:
    request: Any
    chains: dict[Rank, KeyChain]
    pool_chunks: int = 0
    """Leading chunks the pool held at the lookup."""
    local_tokens: int = 0
    """vLLM's own prefix hit at the lookup."""
    saved_chunks: int = 0
    """Leading chunks known to be in the pool or handed to a save."""
    saving: bool = False
    loaded: bool = False
    """A load from the pool was planned: a request loads once. If it failed, vLLM recomputes
    and may ask again (from scratch when the first block failed): the answer is then 0, or
    a pool that keeps answering (a stalled agent's index) would have it try forever."""
    lookup: concurrent.futures.Future[int | None] | None = None
    lookup_since: float = 0.0
    hashes: list[int] = field(default_factory=list)


class SchedulerSide:
    def __init__(self, settings: Settings, model: str) -> None:
        self.settings = settings
        self.layout = settings.layout
        args: dict[str, Any] = dict(name="vllm-scheduler", timeout=settings.timeout,
                                    pod=engine_pod(), model=model,
                                    block_size=self.layout.block_size,
                                    chunk_tokens=self.layout.chunk_tokens,
                                    tenant=self.layout.tenant)
        # Two connections: the scheduler's thread reads the shared-memory index through one;
        # the lookup thread asks the socket through the other (a client is single-threaded).
        self.index = AgentLink(settings.socket, what="scheduler", **args)
        # Inline: it only asks LOOKUPs, so it maps no arena.
        self._socket = AgentLink(settings.socket, what="scheduler lookups", mode="inline",
                                 **args)
        self._lookups = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvpool-lookup")
        self._reqs: dict[str, _Request] = {}
        self._jobs = StepJobs()
        self.workers_down = False
        """A worker last said it cannot reach the agent: no lookups until one says it can
        (each load would wait for the worker's timeout to fail)."""
        if settings.loads:
            self.index.connected()

    # -- lookup

    def _state(self, request: Any) -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = _Request(request, {r: KeyChain(self.layout.fingerprint(*r))
                                    for r in self.layout.ranks()})
            self._reqs[request.request_id] = st
        return st

    def _keys(self, st: _Request, chunks: int) -> dict[Rank, list[bytes]]:
        tokens = st.request.all_token_ids
        return {r: chain.upto(tokens, chunks) for r, chain in st.chains.items()}

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        st.local_tokens = num_computed_tokens
        n = self.layout.chunk_tokens
        # Whole chunks before the prompt's last token (vLLM recomputes that one).
        most = min((request.num_prompt_tokens - 1) // n, MAX_LOOKUP_KEYS)
        if not self.settings.loads or st.loaded or self.workers_down \
                or most * n <= num_computed_tokens \
                or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        hit = self._lookup(st, most)
        if hit is None:
            return None, False  # the socket is asked; vLLM asks again next step
        st.pool_chunks = hit
        st.saved_chunks = max(st.saved_chunks, hit)
        tokens = hit * n - num_computed_tokens
        return (tokens, True) if tokens > 0 else (0, False)

    def _lookup(self, st: _Request, chunks: int) -> int | None:
        """Leading chunks every rank's keys hit, or None while the socket's answer is due."""
        keys = self._keys(st, chunks)
        if st.lookup is not None:
            if st.lookup.done():
                answer, st.lookup = st.lookup.result(), None
                return answer or 0
            if time.monotonic() - st.lookup_since < self.settings.lookup_wait:
                return None
            st.lookup.cancel()
            st.lookup = None
            return self._index_lower_bound(keys)
        client = self.index.connected()
        if client is None:
            return 0
        answers = [client.lookup_nowait(k) for k in keys.values()]
        if all(a is not None for a in answers):
            return min(a for a in answers if a is not None)
        st.lookup = self._lookups.submit(self._socket_lookup, keys)
        st.lookup_since = time.monotonic()
        return None

    def _socket_lookup(self, keys: dict[Rank, list[bytes]]) -> int | None:
        def ask(client: KVPoolClient) -> int:
            return min(client.lookup(k) for k in keys.values())
        return self._socket.call(ask)

    def _index_lower_bound(self, keys: dict[Rank, list[bytes]]) -> int:
        """What the index alone can promise: the leading chunks in DRAM for every rank."""
        client = self.index.connected()
        if client is None:
            return 0
        best = 0
        for size in range(min(len(k) for k in keys.values()), 0, -1):
            if all(client.lookup_nowait(k[:size]) == size for k in keys.values()):
                best = size
                break
        return best

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        st = self._reqs[request.request_id]
        n, bs = self.layout.chunk_tokens, self.layout.block_size
        per = self.layout.blocks_per_chunk
        first = st.local_tokens // n
        end = (st.local_tokens + num_external_tokens) // n
        block_ids = blocks.get_block_ids()[0]
        keys = self._keys(st, end)
        st.loaded = True
        self._jobs.loads.append(LoadJob(
            request.request_id, {r: k[first:end] for r, k in keys.items()},
            array.array("q", block_ids[first * per : end * per]),
            skip_blocks=(st.local_tokens - first * n) // bs))

    # -- saves and the step's metadata

    def step_jobs(self, scheduler_output: Any) -> StepJobs:
        jobs, self._jobs = self._jobs, StepJobs()
        jobs.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        jobs.idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        if not self.settings.saves:
            return jobs
        block_state = scheduler_output.kv_connector_block_state
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or block_state is None:
                continue
            request = st.request
            tokens = request.all_token_ids
            done = min(request.num_computed_tokens + scheduled, len(tokens))
            whole = done // self.layout.chunk_tokens
            if whole <= st.saved_chunks:
                continue
            groups = block_state.get_block_ids(req_id)
            if not groups:
                continue
            jobs.saves.append(self._save_job(st, groups[0], whole))
            st.saved_chunks = whole
            st.saving = True
        return jobs

    def _save_job(self, st: _Request, block_ids: list[int], whole: int) -> SaveJob:
        n, per = self.layout.chunk_tokens, self.layout.blocks_per_chunk
        request = st.request
        keys = self._keys(st, whole)
        first = st.saved_chunks
        hashes = [engine_hash(h) for h in request.block_hashes[: whole * per]]
        tokens = request.all_token_ids
        engine_blocks = [
            EngineBlocks(hashes[c * per : (c + 1) * per], list(tokens[c * n : (c + 1) * n]),
                         hashes[c * per - 1] if c else None)
            if len(hashes) >= (c + 1) * per else None
            for c in range(first, whole)]
        return SaveJob(request.request_id, {r: k[first:whole] for r, k in keys.items()},
                       [list(block_ids[c * per : (c + 1) * per]) for c in range(first, whole)],
                       engine_blocks, push_target(request))

    def finished(self, request: Any) -> bool:
        """Whether vLLM keeps the request's blocks until the workers' saves are done."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False
        if st.lookup is not None:
            st.lookup.cancel()
        if st.saving:
            self._jobs.held.append(request.request_id)
        return st.saving

    def close(self) -> None:
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self.index.close()
        self._socket.close()
