"""The agent's node label against a Kubernetes API emulator on loopback (kmock)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import kubernetes
import pytest

from kvpool.agent.config import AgentConfig
from kvpool.agent.constants import ENV_NODE_NAME as NODE_NAME_ENV
from kvpool.agent.constants import NODE_LABEL_READY as READY
from kvpool.agent.nodelabel import NodeLabeler, label_key

NODE = "gpu-node-1"
POOL = "inference.llama-70b"
KEY = label_key(POOL)


class NodeServer(kmock.KubernetesEmulator):
    """The emulator, recording each request's verb and failing the next `fail` requests."""

    fail = 0

    @property
    def calls(self) -> list[tuple[str, str]]:
        if not hasattr(self, "_calls"):
            self._calls: list[tuple[str, str]] = []
        return self._calls

    async def _handle(self, request: Any) -> Any:
        if request.resource is not None and request.resource.plural:
            method = str(getattr(request.method, "value", request.method))
            verb = {"GET": "get" if request.name else "list", "PATCH": "patch"}.get(
                method, method.lower()
            )
            if request.headers.get("User-Agent", "").startswith("kvpool-agent"):
                self.calls.append((verb, request.resource.plural))
            if self.fail > 0:
                self.fail -= 1
                return aiohttp.web.json_response(
                    {"kind": "Status", "code": 500, "message": "injected"}, status=500
                )
        return await super()._handle(request)


pytestmark = pytest.mark.kmock(cls=NodeServer)


@pytest.fixture
def server(kmock: Any) -> NodeServer:
    kmock.resources.load_bundled()
    kmock.objects["v1/nodes", None, NODE] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
    }
    assert isinstance(kmock, NodeServer)
    return kmock


def _client(server: NodeServer) -> kubernetes.client.ApiClient:
    config = kubernetes.client.Configuration()
    config.host = str(server.url).rstrip("/")
    client = kubernetes.client.ApiClient(config)
    client.user_agent = "kvpool-agent"
    return client


def _labels(server: NodeServer) -> dict[str, str]:
    labels: dict[str, str] = dict(server.objects["v1/nodes", None, NODE]["metadata"]["labels"])
    return labels


async def _until(condition: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _labeler(server: NodeServer, **kwargs: Any) -> NodeLabeler:
    return NodeLabeler(POOL, NODE, _client(server), retry_delay=0.01, retry_max=0.05, **kwargs)


async def test_label_is_set_when_serving_and_removed_on_stop(server: NodeServer) -> None:
    labeler = _labeler(server)
    labeler.start()
    await _until(lambda: _labels(server).get(KEY) == READY, "the ready label")
    assert _labels(server)["kubernetes.io/hostname"] == NODE  # other labels untouched
    await labeler.stop()
    assert KEY not in _labels(server)
    assert _labels(server)["kubernetes.io/hostname"] == NODE
    assert labeler.failures == 0


async def test_label_key_is_the_one_the_webhook_requires() -> None:
    from kvpool.operator import api, webhook

    namespace, name = POOL.split(".", 1)
    assert api.node_label(namespace, name) == KEY
    # What an inference pod of the pool is injected with: a node affinity on exactly
    # the label and value this agent sets.
    pool = api.parse_pool({
        "apiVersion": api.API_VERSION, "kind": api.POOL_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"tiers": {"dram": {"size": "8Gi"}}},
    })
    pod: dict[str, Any] = {"metadata": {"namespace": namespace},
                           "spec": {"containers": [{"name": "engine"}]}}
    webhook.inject(pod, pool)
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": KEY, "operator": "In", "values": [READY]}]}]


async def test_api_errors_are_logged_and_retried_never_raised(
    server: NodeServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvpool.agent.nodelabel")
    server.fail = 4
    labeler = _labeler(server)
    labeler.start()
    await _until(lambda: _labels(server).get(KEY) == READY, "the label after the errors")
    assert labeler.failures == 4 and server.fail == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4 and all("500" in w and NODE in w for w in warnings)
    await labeler.stop()
    assert KEY not in _labels(server)


async def test_stop_gives_up_after_bounded_attempts(server: NodeServer) -> None:
    labeler = _labeler(server, stop_attempts=3)
    labeler.start()
    await _until(lambda: labeler.labelled, "the label")
    server.fail = 100
    await labeler.stop()  # returns: the agent's shutdown is never held up for long
    assert labeler.failures == 3
    assert _labels(server).get(KEY) == READY  # left behind; the next agent start re-sets it


async def test_a_restart_finds_the_label_and_does_not_rewrite_it(server: NodeServer) -> None:
    first = _labeler(server)
    first.start()
    await _until(lambda: first.labelled, "the label")
    server.calls.clear()
    second = _labeler(server)  # a new agent process, before the old one removed it
    second.start()
    await _until(lambda: second.labelled, "the second agent's check")
    assert server.calls == [("get", "nodes")]
    await second.stop()


async def test_a_label_removed_while_serving_is_put_back(
    server: NodeServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvpool.agent.nodelabel")
    labeler = _labeler(server, recheck=0.05)
    labeler.start()
    await _until(lambda: _labels(server).get(KEY) == READY, "the ready label")
    node = server.objects["v1/nodes", None, NODE]
    server.objects["v1/nodes", None, NODE] = {
        **node, "metadata": {**node["metadata"], "labels": {"kubernetes.io/hostname": NODE}}}
    await _until(lambda: _labels(server).get(KEY) == READY, "the label put back")
    # The warning follows the PATCH once the labeler's coroutine resumes: wait for it too.
    await _until(lambda: any("had lost its label" in r.getMessage() for r in caplog.records),
                 "the warning that the label was put back")
    await labeler.stop()
    assert KEY not in _labels(server)


async def test_agent_uses_exactly_the_rbac_the_operator_grants_it(server: NodeServer) -> None:
    """The operator renders a per-pool ClusterRole for the agents: get and patch on nodes.
    The labeler's requests need exactly that, no more and no less."""
    import copy

    from kvpool.operator import api
    from kvpool.operator.render import render
    from tests.operator.op_support import example

    body = copy.deepcopy(example("pool.yaml", api.POOL_KIND))
    role = next(o for o in render(api.parse_pool(body), None) if o["kind"] == "ClusterRole")
    granted = {
        (verb, resource)
        for rule in role["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        if rule["apiGroups"] == [""]
    }
    assert len(role["rules"]) == 1 and role["rules"][0]["apiGroups"] == [""]

    labeler = _labeler(server)
    labeler.start()
    await _until(lambda: labeler.labelled, "the label")
    await labeler.stop()
    assert set(server.calls) == granted == {("get", "nodes"), ("patch", "nodes")}


async def test_outside_a_cluster_or_without_a_node_it_does_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvpool.agent.nodelabel")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv(NODE_NAME_ENV, NODE)
    config = AgentConfig(pool=POOL, socket_path=tmp_path / "agent.sock")
    outside = NodeLabeler.from_config(config)
    assert outside.client is None and outside.node_name == NODE and not outside.enabled
    outside.start()
    await outside.stop()
    assert "not in a cluster" in caplog.text

    monkeypatch.delenv(NODE_NAME_ENV)
    nameless = NodeLabeler.from_config(config, client=kubernetes.client.ApiClient())
    assert nameless.node_name is None and not nameless.enabled
    nameless.start()
    await nameless.stop()
    assert "no node name" in caplog.text


def test_an_agent_outside_a_cluster_never_imports_the_kubernetes_client(
        tmp_path: Path) -> None:
    """Outside a pod the agent's start leaves the `kubernetes` package unimported (a third
    of its start-up CPU); in a pod (the kubelet's service env set) it asks the package,
    which here finds no service account and so no cluster."""
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from kvpool.agent.config import AgentConfig\n"
        "import kvpool.agent.server.agent\n"
        "from kvpool.agent.nodelabel import NodeLabeler\n"
        f"labeler = NodeLabeler.from_config(AgentConfig(socket_path=Path({str(tmp_path)!r})))\n"
        "print(labeler.client is None, 'kubernetes' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    outside = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, timeout=60)
    assert outside.stdout.split() == ["True", "False"], outside.stderr
    env.update(KUBERNETES_SERVICE_HOST="10.0.0.1", KUBERNETES_SERVICE_PORT="443")
    in_pod = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                            text=True, timeout=60)
    assert in_pod.stdout.split() == ["True", "True"], in_pod.stderr


async def test_node_name_comes_from_the_config_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NODE_NAME_ENV, "from-env")
    config = AgentConfig(pool=POOL, socket_path=tmp_path / "s", node_name="from-config")
    assert NodeLabeler.from_config(config, client=None).node_name == "from-config"
    config = AgentConfig(pool=POOL, socket_path=tmp_path / "s")
    assert NodeLabeler.from_config(config, client=None).node_name == "from-env"
