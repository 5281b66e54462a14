"""spec.events: the agent config, the named ports, the headless events Service, and the
refusal of ports that collide; then the operator against the emulator turning events on
and off and refusing a port conflict while the agents keep running."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest
import yaml
from crd_admission import admit
from op_cluster import NAMESPACE, Cluster, Emulator
from op_support import pool_body

from kvpool.agent.config import AgentConfig, EventsPayload, EventsTopic
from kvpool.operator import api, crds, render
from kvpool.operator.webhook import admit_pool

K8S_VERSION = "1.33.0"
POOL = "small"
AGENTS = render.Names(NAMESPACE, POOL).agent
EVENTS_SERVICE = render.Names(NAMESPACE, POOL).events_service


def _pool(**events: Any) -> dict[str, Any]:
    return pool_body(events=events) if events else pool_body()


def _by_kind(objects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for o in objects:
        out.setdefault(o["kind"], []).append(o)
    return out


def _container_ports(objects: list[dict[str, Any]]) -> dict[str, int]:
    (ds,) = _by_kind(objects)["DaemonSet"]
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    return {p["name"]: p["containerPort"] for p in agent["ports"]}


# ----------------------------------------------------------------------------- render


def test_enabled_events_reach_the_agent_config_ports_and_a_headless_service() -> None:
    body = _pool(enabled=True, port=6000, replayPort=6001, payload="array", topic="node",
                 medium={"dram": "CPU", "nvme": "STORAGE"})
    body["metadata"]["uid"] = "6f1e3c1a-2b7d-4c55-9a0e-1d2c3b4a5f60"
    pool = api.parse_pool(body)
    objects = render.render(pool, None)
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    (cm,) = _by_kind(objects)["ConfigMap"]
    cfg = AgentConfig.model_validate(yaml.safe_load(cm["data"]["agent.yaml"]))
    assert cfg.events.enabled and (cfg.events.port, cfg.events.replay_port) == (6000, 6001)
    assert cfg.events.payload is EventsPayload.ARRAY and cfg.events.topic is EventsTopic.NODE
    assert (cfg.events.medium.dram, cfg.events.medium.nvme) == ("CPU", "STORAGE")
    assert cfg.events.medium.shared == "SHARED"  # the default where the pool names none
    assert _container_ports(objects) == {"metrics": 9400, "kv-events": 6000, "kv-replay": 6001}

    services = {s["metadata"]["name"]: s for s in _by_kind(objects)["Service"]}
    events = services[EVENTS_SERVICE]
    assert EVENTS_SERVICE == "kvpool-small-events"
    # Headless, so DNS and EndpointSlices list every agent pod: a router subscribes to each.
    assert events["spec"]["clusterIP"] == "None"
    assert events["spec"]["selector"] == render.selector_labels(pool)
    assert events["spec"]["ports"] == [
        {"name": "kv-events", "port": 6000, "targetPort": "kv-events", "protocol": "TCP"},
        {"name": "kv-replay", "port": 6001, "targetPort": "kv-replay", "protocol": "TCP"},
    ]
    (owner,) = events["metadata"]["ownerReferences"]  # deleted with the pool
    assert (owner["kind"], owner["name"]) == ("KVCachePool", POOL)
    assert ("v1", "Service", EVENTS_SERVICE) not in render.unrendered(pool)


def test_disabled_events_render_no_port_no_service_and_no_config() -> None:
    pool = api.parse_pool(_pool(enabled=False, port=6000))
    objects = render.render(pool, None)
    assert _container_ports(objects) == {"metrics": 9400}
    assert [s["metadata"]["name"] for s in _by_kind(objects)["Service"]] == [
        "kvpool-small-metrics"
    ]
    (cm,) = _by_kind(objects)["ConfigMap"]
    assert "events" not in yaml.safe_load(cm["data"]["agent.yaml"])
    # ... so a pool that never asked for events keeps its agents' config checksum.
    assert objects == render.render(api.parse_pool(_pool()), None)
    assert ("v1", "Service", EVENTS_SERVICE) in render.unrendered(pool)


def test_events_service_of_a_dotted_pool_is_a_dns_label() -> None:
    body = _pool(enabled=True)
    body["metadata"]["name"] = "cache.v1"
    objects = render.render(api.parse_pool(body), None)
    names = [s["metadata"]["name"] for s in _by_kind(objects)["Service"]]
    assert all("." not in n and len(n) <= 63 for n in names)
    assert len(set(names)) == 2
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# ----------------------------------------------------------------------------- validation


CONFLICTS = [
    ("port on metrics", {"enabled": True, "port": 9400}, "spec.events.port: 9400"),
    ("replay on metrics", {"enabled": True, "replayPort": 9400}, "spec.events.replayPort: 9400"),
]


@pytest.mark.parametrize(("what", "events", "field"), CONFLICTS, ids=[c[0] for c in CONFLICTS])
def test_an_events_port_on_the_metrics_port_is_refused_everywhere(
    what: str, events: dict[str, Any], field: str
) -> None:
    body = _pool(**events)
    _, errors = admit(crds.pool_schema(), body)
    assert errors == [
        ".spec.events: events.port and events.replayPort must differ from agent.metricsPort"
    ]
    with pytest.raises(api.PortConflict, match=field) as refused:
        admit_pool(body, render.Settings())
    assert "metricsPort" in str(refused.value)


def test_events_bound_to_one_address_are_refused_for_a_pool() -> None:
    """The agent pod's address is not known before it starts: a pool's agents bind every
    interface of their pod, or the Service reaches nothing."""
    with pytest.raises(api.PortConflict, match=re.escape("spec.events.address: '10.0.0.5'")):
        admit_pool(_pool(enabled=True, address="10.0.0.5"), render.Settings())
    for address in ("*", "0.0.0.0", "::"):
        admit_pool(_pool(enabled=True, address=address), render.Settings())


def test_a_port_conflict_of_disabled_events_is_no_conflict() -> None:
    body = _pool(enabled=False, port=9400)
    assert admit(crds.pool_schema(), body)[1] == []
    admit_pool(body, render.Settings())


def test_the_replay_port_on_the_pub_port_is_refused() -> None:
    body = _pool(enabled=True, port=6000, replayPort=6000)
    _, errors = admit(crds.pool_schema(), body)
    assert errors == [".spec.events.replayPort: replayPort must differ from port"]
    with pytest.raises(api.InvalidSpec, match="replayPort 6000"):
        admit_pool(body, render.Settings())


def test_the_server_defaults_of_events_are_the_agents() -> None:
    body = _pool(enabled=True)
    defaulted, errors = admit(crds.pool_schema(), body)
    assert errors == []
    assert defaulted["spec"]["events"]["port"] == 5557
    assert defaulted["spec"]["events"]["medium"] == {
        "dram": "CPU_PINNED", "nvme": "DISK", "shared": "SHARED"
    }
    assert api.parse_pool(defaulted).spec.events == api.parse_pool(body).spec.events


# ----------------------------------------------------------------------------- operator


def _ports(ds: dict[str, Any] | None) -> dict[str, int]:
    containers = (ds or {}).get("spec", {}).get("template", {}).get("spec", {}).get(
        "containers"
    ) or [{}]
    return {p["name"]: p["containerPort"] for p in containers[0].get("ports") or []}


@pytest.mark.kmock(cls=Emulator)
async def test_operator_turns_events_on_and_off_and_refuses_a_port_conflict(
    cluster: Cluster,
) -> None:
    await cluster.create(_pool(enabled=True))

    async def service() -> dict[str, Any] | None:
        return await cluster.get("v1", "Service", EVENTS_SERVICE)

    svc = await cluster.eventually(service, "the events Service")
    assert [p["name"] for p in svc["spec"]["ports"]] == ["kv-events", "kv-replay"]
    ds = await cluster.get("apps/v1", "DaemonSet", AGENTS)
    assert _ports(ds) == {"metrics": 9400, "kv-events": 5557, "kv-replay": 5558}

    # A conflicting port stored past the webhook: refused with its own reason, nothing
    # that runs changes.
    await cluster.edit_pool(POOL, {"events": {"port": 9400}})

    degraded = await cluster.condition_of(POOL, "Degraded", "True", "PortConflict")
    assert "spec.events.port: 9400" in degraded["message"]
    after = await cluster.get("apps/v1", "DaemonSet", AGENTS)
    assert after is not None and after["spec"]["template"] == ds["spec"]["template"]
    assert await service() is not None

    # Events off: the ports leave the agents and the Service is deleted.
    await cluster.edit_pool(POOL, {"events": {"enabled": False, "port": 5557}})

    async def off() -> bool:
        ds = await cluster.get("apps/v1", "DaemonSet", AGENTS)
        cm = await cluster.get("v1", "ConfigMap", AGENTS)
        agent_yaml = yaml.safe_load(((cm or {}).get("data") or {}).get("agent.yaml", "{}"))
        return (
            _ports(ds) == {"metrics": 9400}
            and "events" not in agent_yaml
            and await service() is None
        )

    await cluster.eventually(off, "the events ports and Service gone")

    await cluster.condition_of(POOL, "Degraded", "False", "AsExpected")  # the conflict is gone
