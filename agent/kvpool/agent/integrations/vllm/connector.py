"""`KVPoolConnector`: kvpool as a vLLM v1 KV connector (`KVConnectorBase_V1`).

vLLM builds one with the scheduler role in its engine core and one with the worker role in
each worker; each delegates to its side (`scheduler.py`, `worker.py`). Loads are
asynchronous (the request waits for its KV while others run) and saves are asynchronous (a
finished request's blocks are kept until its chunks are stored). Layer-by-layer hooks
(`wait_for_layer_load`, `save_kv_layer`) have nothing to do: a request's KV is loaded
before it runs, and saved once its step's forward has written it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from .jobs import StepJobs, WorkerReport
from .link import LOGGER
from .scheduler import SchedulerSide
from .settings import settings as read_settings
from .worker import WorkerSide

log = logging.getLogger(LOGGER)


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    jobs: StepJobs


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    report: WorkerReport

    def aggregate(self, other: Any) -> KVPoolWorkerMetadata:
        down = self.report.agent_down or bool(getattr(other, "report", None)
                                               and other.report.agent_down)
        return KVPoolWorkerMetadata(WorkerReport(agent_down=down))


def _rank() -> tuple[int, int]:
    from vllm.distributed.parallel_state import (
        get_pipeline_model_parallel_rank,
        get_tensor_model_parallel_rank,
    )
    return get_tensor_model_parallel_rank(), get_pipeline_model_parallel_rank()


class KVPoolConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's KV connector for the node's kvpool agent (docs/integrations.md)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = read_settings(vllm_config, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            # The pool is a cache: a chunk it cannot deliver (evicted, corrupt, the agent
            # gone) is recomputed, never a failed request. vLLM's scheduler reads the policy
            # after building its connector.
            log.info("kvpool: kv_load_failure_policy %r -> 'recompute' (a chunk the pool "
                     "cannot deliver is recomputed)", transfer.kv_load_failure_policy)
            transfer.kv_load_failure_policy = "recompute"
        model = str(vllm_config.model_config.served_model_name or self.settings.layout.model)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.settings, model)
        else:
            self.worker = WorkerSide(self.settings, model, _rank())

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a later miss

    # -- scheduler side

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        try:
            return self.scheduler.matched_tokens(request, num_computed_tokens)
        except Exception:  # never an exception out of the connector
            log.exception("kvpool: lookup of request %s failed; computing it",
                          request.request_id)
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVPoolConnectorMetadata:
        assert self.scheduler is not None
        return KVPoolConnectorMetadata(self.scheduler.step_jobs(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        # Loads and saves report through get_finished; the workers' metadata says whether
        # they reach the agent.
        assert self.scheduler is not None
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVPoolWorkerMetadata):
            self.scheduler.workers_down = meta.report.agent_down

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.finished(request), None

    def take_events(self) -> Iterable[Any]:
        # The agent publishes the pool's KV events itself, under vLLM's block hashes
        # (docs/events.md); publishing them through vLLM too would announce each chunk twice.
        return ()

    # -- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches, self._num_blocks)

    def _jobs(self) -> StepJobs:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolConnectorMetadata)
        return meta.jobs

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        assert self.worker is not None
        if isinstance(kv_connector_metadata, KVPoolConnectorMetadata) \
                and kv_connector_metadata.jobs.preempted:
            self.worker.wait_for_saves(kv_connector_metadata.jobs.preempted)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_step(self._jobs())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.end_step(self._jobs())

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        # The step's jobs say whether it computed nothing (then a load in flight is worth
        # a short wait); a caller outside a step, with no metadata bound, never waits.
        meta = self._connector_metadata if self.has_connector_metadata() else None
        idle = isinstance(meta, KVPoolConnectorMetadata) and meta.jobs.idle
        return self.worker.finished(idle=idle)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.load_errors()

    def build_connector_worker_meta(self) -> KVPoolWorkerMetadata | None:
        assert self.worker is not None
        return KVPoolWorkerMetadata(WorkerReport(agent_down=self.worker.agent_down()))

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()
