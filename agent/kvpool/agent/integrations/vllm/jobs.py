"""What the scheduler side asks the workers to do in one engine step (pure data, no vLLM).

It travels inside vLLM's connector metadata to every worker; each worker takes the keys of
its own rank.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field

from ...protocol import EngineBlocks

Rank = tuple[int, int]
"""(tensor-parallel rank, pipeline-parallel rank)."""


@dataclass(slots=True)
class LoadJob:
    """Copy a request's stored chunks from the pool into its vLLM blocks."""

    req_id: str
    keys: dict[Rank, list[bytes]]
    """Per rank, the keys of the chunks to load, in token order."""
    block_ids: array.array[int]
    """The vLLM blocks the chunks fill, flat (i64): chunk i's are `block_ids[i * per :
    (i + 1) * per]`, `per` the layout's blocks a chunk; as the worker's compiled read takes
    them (`hostcopy.BlockTargets`), with no list a chunk made or read on the way."""
    skip_blocks: int = 0
    """Leading blocks of the first chunk that vLLM already holds (its own prefix cache):
    never written, their bytes are read past."""

    def chunks(self, per: int) -> list[list[int]]:
        """The block ids, a list a chunk."""
        ids = self.block_ids.tolist()
        return [ids[k : k + per] for k in range(0, len(ids), per)]


@dataclass(slots=True)
class SaveJob:
    """Copy a request's newly computed whole chunks from its vLLM blocks into the pool."""

    req_id: str
    keys: dict[Rank, list[bytes]]
    block_ids: list[list[int]]
    engine_blocks: list[EngineBlocks | None]
    """Per chunk, vLLM's block hashes, tokens and parent hash: what KV events say of it."""
    to: str | None = None
    """The node that will read the chunks (a hand-off: the agent pushes them there), from
    the request's `kv_transfer_params`; None: stored here, read by key from anywhere."""


@dataclass(slots=True)
class StepJobs:
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    """Finished requests whose blocks vLLM keeps until the worker says their saves are done."""
    preempted: set[str] = field(default_factory=set)
    """Requests preempted this step: their blocks may be reused, so their saves finish first."""
    idle: bool = False
    """The step computes no token (every request waits, e.g. for its KV): the worker may
    wait a little for its loads rather than hand vLLM back a step it would only repeat."""


@dataclass(slots=True)
class WorkerReport:
    """What workers tell the scheduler side after a step."""

    agent_down: bool = False
    """This worker cannot reach the agent (any worker down: all are, for the scheduler)."""
