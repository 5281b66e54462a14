"""The agent's node label: `pool.kvpool.io/<pool>=ready` while it serves the pool.

The operator's pod webhook gives every pod of a pool a required node affinity on this
label, so an inference pod only lands on a node whose agent is ready. The agent sets
the label once it serves (`start()`), checks it every few minutes while serving (putting
it back if it was removed), and removes it when it stops (`stop()`), with the
per-pool RBAC the operator renders: `get` and `patch` on nodes, nothing else.

It never takes the agent down: outside a cluster, or without a node name
(`AgentConfig.node_name`, else the `KVPOOL_NODE_NAME` env the DaemonSet sets from the
downward API), it does nothing and says so once; API errors are logged and retried
with backoff in the background; removal on stop is attempted a bounded number of times.

Blocking `kubernetes` client calls run in a worker thread: the agent's event loop (the
LOOKUP/ACQUIRE path) never waits for the API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from .config import AgentConfig
from .constants import ENV_NODE_NAME, NODE_LABEL_PREFIX, NODE_LABEL_READY

if TYPE_CHECKING:
    import kubernetes

log = logging.getLogger("kvpool.agent.nodelabel")

RECHECK_INTERVAL = 300.0
"""While serving, the label is checked this often and put back if someone removed it."""


def label_key(pool: str) -> str:
    """The node label of pool `<namespace>.<name>`."""
    return NODE_LABEL_PREFIX + pool


def backoff(attempt: int, base: float, cap: float) -> float:
    """Seconds before the next attempt after `attempt` failures: doubling, at most `cap`."""
    return float(min(cap, base * 2 ** min(attempt, 30)))


IN_CLUSTER_ENV = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")
"""What the kubelet sets in every pod, and the first thing the `kubernetes` package's
in-cluster configuration needs (it refuses without either)."""


def in_cluster_client() -> kubernetes.client.ApiClient | None:
    """A client with the pod's service account, or None outside a cluster.

    Outside a pod (no `IN_CLUSTER_ENV`) the `kubernetes` package is not even imported: it
    is a third of the agent's start-up CPU, which every agent on a laptop, a bare-metal
    node or in a test would otherwise pay for nothing."""
    if not all(os.environ.get(name) for name in IN_CLUSTER_ENV):
        return None
    import kubernetes

    config = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)
    except kubernetes.config.ConfigException:
        return None
    client = kubernetes.client.ApiClient(config)
    client.user_agent = "kvpool-agent"
    return client


class NodeLabeler:
    """Sets and removes the pool's ready label on this agent's node."""

    def __init__(
        self,
        pool: str,
        node_name: str | None,
        client: kubernetes.client.ApiClient | None,
        *,
        retry_delay: float = 1.0,
        retry_max: float = 60.0,
        stop_attempts: int = 3,
        recheck: float = RECHECK_INTERVAL,
    ) -> None:
        self.key = label_key(pool)
        self.node_name = node_name
        self.client = client
        self.retry_delay = retry_delay
        self.retry_max = retry_max
        self.stop_attempts = stop_attempts
        self.recheck = recheck
        self.labelled = False
        """The label is known to be on the node."""
        self.failures = 0
        """Failed API calls so far (each one logged)."""
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def from_config(
        cls, config: AgentConfig, client: kubernetes.client.ApiClient | None = None
    ) -> NodeLabeler:
        """The agent's labeler: node from the config or `KVPOOL_NODE_NAME`, the in-cluster
        service account unless a client is given."""
        node = config.node_name or os.environ.get(ENV_NODE_NAME) or None
        return cls(config.pool, node, client if client is not None else in_cluster_client())

    @property
    def enabled(self) -> bool:
        return self.client is not None and bool(self.node_name)

    # ----------------------------------------------------------------------- API calls

    def _call(self, method: str, body: Any = None) -> dict[str, Any]:
        assert self.client is not None and self.node_name
        data = self.client.call_api(
            f"/api/v1/nodes/{self.node_name}",
            method,
            header_params={
                "Accept": "application/json",
                "Content-Type": "application/merge-patch+json",
            },
            body=body,
            response_types_map={200: "object"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
            _preload_content=False,
            _request_timeout=10,
        )
        try:
            result: dict[str, Any] = json.loads(data.data or b"{}")
        finally:
            data.release_conn()
        return result

    def _set(self) -> bool:
        """Make sure the label is on the node; True if it had to be (re)written."""
        node = self._call("GET")
        labels = (node.get("metadata") or {}).get("labels") or {}
        missing = labels.get(self.key) != NODE_LABEL_READY  # a warm restart finds it set already
        if missing:
            self._call("PATCH", {"metadata": {"labels": {self.key: NODE_LABEL_READY}}})
        self.labelled = True
        return missing

    def _remove(self) -> None:
        self._call("PATCH", {"metadata": {"labels": {self.key: None}}})
        self.labelled = False

    # ----------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Label the node in the background (retried until it works or `stop()`)."""
        if not self.enabled:
            why = "no node name (KVPOOL_NODE_NAME)" if self.client else "not in a cluster"
            log.info("node label %s not set: %s", self.key, why)
            return
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._keep_trying(), name="kvpool-node-label"
            )

    async def _keep_trying(self) -> None:
        """Label the node, then keep checking: a label removed by hand (or by a node
        update) while the agent serves would keep new pods of the pool off this node."""
        attempt = 0
        labelled_once = False
        while True:
            try:
                rewritten = await asyncio.to_thread(self._set)
            except Exception as e:  # any API or transport error: log, wait, retry
                self.failures += 1
                delay = backoff(attempt, self.retry_delay, self.retry_max)
                log.warning(
                    "cannot label node %s with %s=%s (retrying in %.1fs): %s",
                    self.node_name,
                    self.key,
                    NODE_LABEL_READY,
                    delay,
                    _short(e),
                )
                attempt += 1
                await asyncio.sleep(delay)
            else:
                attempt = 0
                if not labelled_once:
                    log.info("node %s labelled %s=%s", self.node_name, self.key, NODE_LABEL_READY)
                elif rewritten:
                    log.warning("node %s had lost its label %s=%s: put back",
                                self.node_name, self.key, NODE_LABEL_READY)
                labelled_once = True
                await asyncio.sleep(self.recheck)

    async def stop(self) -> None:
        """Stop trying to label, and remove the label (a bounded number of attempts)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if not self.enabled:
            return
        for attempt in range(self.stop_attempts):
            try:
                await asyncio.to_thread(self._remove)
            except Exception as e:  # the agent is stopping: log, and retry a few times
                self.failures += 1
                log.warning(
                    "cannot remove label %s from node %s (attempt %d of %d): %s",
                    self.key,
                    self.node_name,
                    attempt + 1,
                    self.stop_attempts,
                    _short(e),
                )
                if attempt + 1 < self.stop_attempts:
                    await asyncio.sleep(backoff(attempt, self.retry_delay, self.retry_max))
            else:
                log.info("label %s removed from node %s", self.key, self.node_name)
                return


def _short(e: BaseException) -> str:
    """An API error without its response headers and body."""
    import kubernetes  # already imported: a labeler making API calls has a client

    if isinstance(e, kubernetes.client.exceptions.ApiException):
        return f"{e.status} {e.reason}"
    return f"{type(e).__name__}: {e}"
