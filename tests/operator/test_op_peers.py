"""spec.peers: what the operator renders for the peer tier (the agents' config section, the
container port, the pool's Secret, the headless Service, the NetworkPolicy), the refusal of
a peer port that collides with another port of the agent, and the operator against the
emulator: the Secret made once and kept across re-renders, TLS, and peers turned off."""

from __future__ import annotations

import base64
import copy
import os
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from crd_admission import admit
from op_cluster import NAMESPACE, Cluster, Emulator
from op_support import example

from kvpool.agent.config import AgentConfig, expand_env
from kvpool.agent.peers.auth import read_secret
from kvpool.operator import api, crds, handlers, render
from kvpool.operator.webhook import admit_pool

K8S_VERSION = "1.33.0"
POOL = "small"
UID = "6f1e3c1a-2b7d-4c55-9a0e-1d2c3b4a5f60"
NAMES = render.Names(NAMESPACE, POOL)
PEERS = NAMES.peers
TLS_SECRET = "small-peers-tls"


def _pool(peers: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(example("pool-minimal.yaml", api.POOL_KIND))
    body["metadata"]["namespace"] = NAMESPACE
    if peers is not None:
        body["spec"]["peers"] = peers
    body["spec"].update(spec)
    return body


# ----------------------------------------------------------------------------- validation

CEL_MESSAGE = (
    ".spec.peers.port: peers.port must differ from agent.metricsPort, events.port and "
    "events.replayPort"
)
CONFLICTS = [
    ("metrics", {}, 9400, "spec.peers.port: 9400 is also spec.agent.metricsPort"),
    ("metrics moved", {"agent": {"metricsPort": 9410}}, 9410,
     "spec.peers.port: 9410 is also spec.agent.metricsPort"),
    ("events", {"events": {"enabled": True}}, 5557,
     "spec.peers.port: 5557 is also spec.events.port"),
    ("replay", {"events": {"enabled": True}}, 5558,
     "spec.peers.port: 5558 is also spec.events.replayPort"),
]


@pytest.mark.parametrize(("what", "spec", "port", "message"), CONFLICTS,
                         ids=[c[0] for c in CONFLICTS])
def test_a_peer_port_on_another_port_of_the_agent_is_refused_everywhere(
    what: str, spec: dict[str, Any], port: int, message: str
) -> None:
    body = _pool({"enabled": True, "port": port}, **spec)
    _, errors = admit(crds.pool_schema(), body)
    assert errors == [CEL_MESSAGE]
    with pytest.raises(api.PortConflict, match=re.escape(message)):
        admit_pool(body, render.Settings())


def test_a_peer_port_that_collides_only_while_off_is_no_conflict() -> None:
    for body in (
        _pool({"enabled": False, "port": 9400}),
        # Events off: their ports are not the agent's.
        _pool({"enabled": True, "port": 5557}, events={"enabled": False}),
    ):
        assert admit(crds.pool_schema(), body)[1] == []
        admit_pool(body, render.Settings())


def test_the_server_defaults_of_peers_are_the_models() -> None:
    body = _pool()
    defaulted, errors = admit(crds.pool_schema(), body)
    assert errors == []
    assert defaulted["spec"]["peers"] == {"enabled": False, "port": 9410, "timeout": "250ms",
                                          "secretGrace": "5m", "remoteChunks": 1_000_000,
                                          "networkPolicy": True}
    assert api.parse_pool(defaulted).spec.peers == api.parse_pool(body).spec.peers
    on = _pool({"enabled": True, "tls": {"secretName": "pool-tls"}})
    defaulted, errors = admit(crds.pool_schema(), on)
    assert errors == []
    assert defaulted["spec"]["peers"]["port"] == 9410


@pytest.mark.parametrize(
    ("peers", "error"),
    [
        ({"enabled": True, "port": 80}, ".spec.peers.port: 80 is less than the minimum of 1024"),
        ({"enabled": True, "tls": {}}, ".spec.peers.tls: 'secretName' is a required property"),
        ({"enabled": True, "tls": {"secretName": ""}},
         ".spec.peers.tls.secretName: '' should be non-empty"),
        ({"enabled": True, "timeout": "0s"},
         ".spec.peers.timeout: must be a duration greater than zero, like 30s, 5m, 1h, 7d"),
        ({"enabled": True, "timeout": "soon"},
         ".spec.peers.timeout: must be a duration greater than zero, like 30s, 5m, 1h, 7d"),
    ],
)
def test_a_bad_peers_field_is_refused_by_the_schema_and_the_operator(
    peers: dict[str, Any], error: str
) -> None:
    body = _pool(peers)
    assert error in admit(crds.pool_schema(), body)[1]
    with pytest.raises(api.InvalidSpec, match=re.escape("spec.peers")):
        admit_pool(body, render.Settings())


# ----------------------------------------------------------------------------- render


def _render(body: dict[str, Any]) -> list[dict[str, Any]]:
    body = copy.deepcopy(body)
    body["metadata"]["uid"] = UID
    objects = render.render(api.parse_pool(body), None)
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return objects


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _agent(objects: list[dict[str, Any]]) -> dict[str, Any]:
    ds = _one(objects, "DaemonSet", NAMES.agent)
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _config(objects: list[dict[str, Any]]) -> AgentConfig:
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap"]
    return AgentConfig.model_validate(yaml.safe_load(cm["data"]["agent.yaml"]))


def _owned(obj: dict[str, Any]) -> None:
    (owner,) = obj["metadata"]["ownerReferences"]  # deleted with the pool
    assert (owner["kind"], owner["name"], owner["uid"]) == (api.POOL_KIND, POOL, UID)


def test_peers_reach_the_agent_config_port_secret_service_and_network_policy() -> None:
    objects = _render(_pool({"enabled": True, "port": 9500}))
    assert PEERS == "kvpool-small-peers"

    peers = _config(objects).peers
    assert peers.enabled and peers.port == 9500 and peers.address == "*"
    # Each agent advertises its own pod's address: the ConfigMap is the same on every node,
    # so the address comes from the pod's env (downward API), named in Kubernetes' syntax.
    assert peers.advertise == "$(POD_IP)"
    assert peers.discovery == "kvpool-small-peers.inference.svc"
    assert str(peers.secret_file) == "/etc/kvpool-peers/secret"
    assert peers.tls is None
    # The directory is capped at what the agent's memory is sized for (remoteChunks).
    assert peers.max_entries == 1_000_000
    capped = _pool({"enabled": True, "remoteChunks": 2_500_000})
    assert _config(_render(capped)).peers.max_entries == 2_500_000
    # Reads from peers time out after the pool's timeout (a slow link wants a longer one).
    assert peers.timeout == 0.25
    slow = _pool({"enabled": True, "timeout": "1500ms"})
    assert _config(_render(slow)).peers.timeout == 1.5
    # A rotated secret's grace: the agents' default, or the pool's (short, after a leak).
    assert peers.secret_grace == 300
    leaked = _pool({"enabled": True, "secretGrace": "90s"})
    assert _config(_render(leaked)).peers.secret_grace == 90

    agent = _agent(objects)
    assert {p["name"]: p["containerPort"] for p in agent["ports"]} == {
        "metrics": 9400, "kv-peers": 9500
    }
    env = {e["name"]: e for e in agent["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    assert mounts["peers"] == {"name": "peers", "mountPath": "/etc/kvpool-peers", "readOnly": True}
    volumes = {
        v["name"]: v for v in _one(objects, "DaemonSet", NAMES.agent)["spec"]["template"]["spec"][
            "volumes"
        ]
    }
    assert volumes["peers"]["projected"]["sources"] == [
        {"secret": {"name": PEERS, "items": [{"key": "secret", "path": "secret"}]}}
    ]
    # The init container hands host directories to the agent: the Secret is none of them.
    ds = _one(objects, "DaemonSet", NAMES.agent)
    (init,) = ds["spec"]["template"]["spec"]["initContainers"]
    assert "/etc/kvpool-peers" not in init["command"]

    secret = _one(objects, "Secret", PEERS)
    # Render is pure: the Secret's random value is made by the operator when it creates it.
    assert "data" not in secret and "stringData" not in secret
    assert secret["type"] == "Opaque"

    service = _one(objects, "Service", PEERS)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == render.selector_labels(api.parse_pool(_pool()))
    assert service["spec"]["ports"] == [
        {"name": "kv-peers", "port": 9500, "targetPort": "kv-peers", "protocol": "TCP"}
    ]

    policy = _one(objects, "NetworkPolicy", PEERS)["spec"]
    agents = {"matchLabels": render.selector_labels(api.parse_pool(_pool()))}
    assert policy["podSelector"] == agents
    assert policy["policyTypes"] == ["Ingress"]  # egress untouched
    # The peer port from the pool's agents only; the agent's other ports from anywhere, as
    # they were before a policy selected the agent pods.
    assert policy["ingress"] == [
        {"from": [{"podSelector": agents}], "ports": [{"protocol": "TCP", "port": 9500}]},
        {"ports": [{"protocol": "TCP", "port": 9400}]},
    ]
    for obj in (secret, service, _one(objects, "NetworkPolicy", PEERS)):
        _owned(obj)
    assert render.unrendered(api.parse_pool(_pool({"enabled": True}))) == [
        ("v1", "Service", NAMES.events_service)
    ]
    # The Secret and the policy come before the agents that mount and are guarded by them.
    kinds = [o["kind"] for o in objects]
    assert kinds.index("Secret") < kinds.index("DaemonSet")
    assert kinds.index("NetworkPolicy") < kinds.index("DaemonSet")


def test_the_network_policy_leaves_the_events_ports_open() -> None:
    objects = _render(_pool({"enabled": True}, events={"enabled": True}))
    policy = _one(objects, "NetworkPolicy", PEERS)["spec"]
    assert policy["ingress"][1] == {
        "ports": [
            {"protocol": "TCP", "port": 9400},
            {"protocol": "TCP", "port": 5557},
            {"protocol": "TCP", "port": 5558},
        ]
    }
    assert {p["name"] for p in _agent(objects)["ports"]} == {
        "metrics", "kv-events", "kv-replay", "kv-peers"
    }


def test_peers_without_the_operators_network_policy_render_the_rest() -> None:
    """For clusters whose own NetworkPolicies govern the agent pods: the operator's would
    admit the metrics and events ports from anywhere, and policies add up."""
    body = _pool({"enabled": True, "networkPolicy": False}, events={"enabled": True})
    objects = _render(body)
    assert {o["kind"] for o in objects if o["metadata"]["name"] == PEERS} == {"Secret", "Service"}
    assert "kv-peers" in {p["name"] for p in _agent(objects)["ports"]}
    assert ("networking.k8s.io/v1", "NetworkPolicy", PEERS) in render.unrendered(
        api.parse_pool(body)
    )


def test_peers_with_tls_mount_the_certificate_secret_beside_the_pools_secret() -> None:
    objects = _render(_pool({"enabled": True, "tls": {"secretName": TLS_SECRET}}))
    tls = _config(objects).peers.tls
    assert tls is not None
    assert (str(tls.cert_file), str(tls.key_file), str(tls.ca_file)) == (
        "/etc/kvpool-peers/tls.crt", "/etc/kvpool-peers/tls.key", "/etc/kvpool-peers/ca.crt"
    )
    ds = _one(objects, "DaemonSet", NAMES.agent)
    (volume,) = [v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "peers"]
    assert volume["projected"]["sources"][1] == {
        "secret": {
            "name": TLS_SECRET,
            "items": [{"key": k, "path": k} for k in ("tls.crt", "tls.key", "ca.crt")],
        }
    }


def test_peers_off_render_nothing_of_them_and_keep_the_agents_config() -> None:
    objects = _render(_pool({"enabled": False, "port": 9500, "tls": {"secretName": TLS_SECRET}}))
    assert [o for o in objects if o["metadata"]["name"] == PEERS] == []
    assert "peers" not in yaml.safe_load(
        _one(objects, "ConfigMap", NAMES.agent)["data"]["agent.yaml"]
    )
    agent = _agent(objects)
    assert [p["name"] for p in agent["ports"]] == ["metrics"]
    assert "POD_IP" not in {e["name"] for e in agent["env"]}
    assert "peers" not in {m["name"] for m in agent["volumeMounts"]}
    # ... so a pool that never asked for peers keeps its agents' config checksum.
    assert objects == _render(_pool())
    assert render.unrendered(api.parse_pool(_pool())) == [
        ("v1", "Service", NAMES.events_service),
        ("v1", "Service", PEERS),
        ("networking.k8s.io/v1", "NetworkPolicy", PEERS),
        ("v1", "Secret", PEERS),
    ]


def test_the_peer_objects_of_a_dotted_pool_have_dns_label_names() -> None:
    body = _pool({"enabled": True})
    body["metadata"]["name"] = "cache.v1"
    objects = _render(body)
    name = render.Names(NAMESPACE, "cache.v1").peers
    assert "." not in name and len(name) <= 63
    assert {o["kind"] for o in objects if o["metadata"]["name"] == name} == {
        "Secret", "Service", "NetworkPolicy"
    }
    assert _config(objects).peers.discovery == f"{name}.inference.svc"


def test_the_agent_takes_the_secret_and_the_address_the_operator_gives_it(
    tmp_path: Path,
) -> None:
    """The Secret's value the operator makes, mounted as the kubelet mounts it (the data's
    base64 decoded into the file), is a pool secret the agent reads whole; `$(POD_IP)` in the
    shared config becomes each agent's own pod address."""
    pool = api.parse_pool(_pool({"enabled": True}))
    objects = render.render(pool, None)
    (secret,) = [o for o in objects if o["kind"] == "Secret"]
    made = handlers.generated(secret)
    assert made is not None and set(made) == {"data"} and set(made["data"]) == {"secret"}
    path = tmp_path / "secret"
    path.write_bytes(base64.b64decode(made["data"]["secret"]))
    value = read_secret(path)
    assert len(bytes.fromhex(value.decode())) == 32
    assert handlers.generated(secret) != made  # random: each pool gets its own
    assert [o for o in objects if o["kind"] != "Secret" and handlers.generated(o)] == []
    advertise = render.peers_config(pool).advertise
    assert advertise is not None
    assert expand_env(advertise, {"POD_IP": "10.1.2.3"}) == "10.1.2.3"


# ----------------------------------------------------------------------------- operator


def _condition(pool: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((pool or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


async def _peer_objects(cluster: Cluster) -> dict[str, dict[str, Any] | None]:
    return {
        "Secret": await cluster.get("v1", "Secret", PEERS),
        "Service": await cluster.get("v1", "Service", PEERS),
        "NetworkPolicy": await cluster.get("networking.k8s.io/v1", "NetworkPolicy", PEERS),
    }


def _secret_value(secret: dict[str, Any] | None) -> bytes:
    return base64.b64decode(((secret or {}).get("data") or {}).get("secret") or "")


def _random_32_bytes(value: bytes) -> bool:
    """The secret's form: 32 random bytes as 64 hex digits (text the agent reads whole)."""
    return len(value) == 64 and len(bytes.fromhex(value.decode())) == 32


def _ports(ds: dict[str, Any] | None) -> set[str]:
    containers = (ds or {}).get("spec", {}).get("template", {}).get("spec", {}).get(
        "containers"
    ) or [{}]
    return {p["name"] for p in containers[0].get("ports") or []}


@pytest.mark.kmock(cls=Emulator)
async def test_operator_creates_the_peer_objects_keeps_the_secret_and_removes_them(
    cluster: Cluster,
) -> None:
    await cluster.create(_pool({"enabled": True}))

    async def created() -> dict[str, dict[str, Any] | None] | None:
        objects = await _peer_objects(cluster)
        return objects if all(objects.values()) else None

    objects = await cluster.eventually(created, "the peer Secret, Service and NetworkPolicy")
    pool = await cluster.pool(POOL)
    assert pool is not None
    for obj in objects.values():
        assert obj is not None
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == (
            api.POOL_KIND, POOL, pool["metadata"]["uid"]
        )
    first = _secret_value(objects["Secret"])
    assert _random_32_bytes(first) and first != b"0" * 64
    ds = await cluster.get("apps/v1", "DaemonSet", NAMES.agent)
    assert "kv-peers" in _ports(ds)

    # A re-render (the agents' config changes, the DaemonSet rolls) keeps the secret the
    # running agents hold; so does drift repaired on the Secret's labels.
    await cluster.patch("v1", "Secret", PEERS,
                        {"metadata": {"labels": {"app.kubernetes.io/part-of": "drifted"}}})
    await cluster.patch(api.API_VERSION, api.POOL_KIND, POOL,
                        {"spec": {"agent": {"logLevel": "debug"}}})

    async def rerendered() -> bool:
        cm = await cluster.get("v1", "ConfigMap", NAMES.agent)
        agent_yaml = yaml.safe_load(((cm or {}).get("data") or {}).get("agent.yaml", "{}"))
        secret = await cluster.get("v1", "Secret", PEERS)
        labels = ((secret or {}).get("metadata") or {}).get("labels") or {}
        return (
            agent_yaml.get("logLevel") == "debug"
            and labels.get("app.kubernetes.io/part-of") == "kvpool"
        )

    await cluster.eventually(rerendered, "the pool re-rendered and the Secret repaired")
    assert _secret_value(await cluster.get("v1", "Secret", PEERS)) == first

    # A Secret that lost its value (emptied by hand) gets one again; a value it holds is
    # never replaced.
    await cluster.patch("v1", "Secret", PEERS, {"data": {"secret": None}})
    await cluster.patch(api.API_VERSION, api.POOL_KIND, POOL,
                        {"spec": {"agent": {"logLevel": "info"}}})

    async def refilled() -> bytes | None:
        value = _secret_value(await cluster.get("v1", "Secret", PEERS))
        return value or None

    second = await cluster.eventually(refilled, "the Secret given a value again")
    assert _random_32_bytes(second) and second != first

    # Rotated by an admin (docs/cross-node.md, "Rotating the secret and renewing
    # certificates": a new value written into the Secret): the operator's reconciles keep
    # it, and never put the one it made back.
    rotated = os.urandom(32).hex().encode()
    await cluster.patch("v1", "Secret", PEERS,
                        {"data": {"secret": base64.b64encode(rotated).decode()}})
    await cluster.patch(api.API_VERSION, api.POOL_KIND, POOL,
                        {"spec": {"agent": {"logLevel": "debug"}}})
    await cluster.eventually(rerendered, "the pool re-rendered after the rotation")
    assert _secret_value(await cluster.get("v1", "Secret", PEERS)) == rotated

    # The operator's NetworkPolicy turned off: it is deleted, the rest of the tier stays.
    await cluster.patch(api.API_VERSION, api.POOL_KIND, POOL,
                        {"spec": {"peers": {"networkPolicy": False}}})

    async def policy_off() -> bool:
        objects = await _peer_objects(cluster)
        return objects["NetworkPolicy"] is None and bool(objects["Secret"] and objects["Service"])

    await cluster.eventually(policy_off, "the NetworkPolicy deleted, Secret and Service kept")
    assert _secret_value(await cluster.get("v1", "Secret", PEERS)) == rotated

    # Peers off: the port leaves the agents, the three objects are deleted.
    await cluster.patch(api.API_VERSION, api.POOL_KIND, POOL,
                        {"spec": {"peers": {"enabled": False}}})

    async def off() -> bool:
        ds = await cluster.get("apps/v1", "DaemonSet", NAMES.agent)
        cm = await cluster.get("v1", "ConfigMap", NAMES.agent)
        agent_yaml = yaml.safe_load(((cm or {}).get("data") or {}).get("agent.yaml", "{}"))
        objects = await _peer_objects(cluster)
        return (
            "kv-peers" not in _ports(ds)
            and "peers" not in agent_yaml
            and not any(objects.values())
        )

    await cluster.eventually(off, "the peer port and objects gone")

    # On again: a new Secret, a new secret.
    await cluster.patch(api.API_VERSION, api.POOL_KIND, POOL,
                        {"spec": {"peers": {"enabled": True, "networkPolicy": True}}})
    objects = await cluster.eventually(created, "the peer objects again")
    third = _secret_value(objects["Secret"])
    assert _random_32_bytes(third) and third not in (first, second, rotated)


@pytest.mark.kmock(cls=Emulator)
async def test_a_missing_tls_secret_degrades_the_pool_until_it_exists(cluster: Cluster) -> None:
    await cluster.create(_pool({"enabled": True, "tls": {"secretName": TLS_SECRET}}))

    async def degraded(reason: str) -> dict[str, Any] | None:
        pool = await cluster.pool(POOL)
        return pool if _condition(pool, "Degraded").get("reason") == reason else None

    pool = await cluster.eventually(lambda: degraded("SecretNotFound"), "SecretNotFound")
    assert f"Secret '{TLS_SECRET}' (spec.peers.tls.secretName)" in _condition(
        pool, "Degraded"
    )["message"]
    assert await cluster.get("apps/v1", "DaemonSet", NAMES.agent) is None

    tls: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": TLS_SECRET, "namespace": NAMESPACE},
        "type": "kubernetes.io/tls",
        "data": {"tls.crt": "Y2VydA==", "tls.key": "a2V5"},
    }
    await cluster.create(tls)
    pool = await cluster.eventually(lambda: degraded("SecretKeyMissing"), "SecretKeyMissing")
    assert "has no key ca.crt" in _condition(pool, "Degraded")["message"]

    await cluster.patch("v1", "Secret", TLS_SECRET, {"data": {"ca.crt": "Y2E="}})
    await cluster.eventually(lambda: degraded("AsExpected"), "Degraded=False")
    ds = await cluster.get("apps/v1", "DaemonSet", NAMES.agent)
    assert ds is not None
    (volume,) = [v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "peers"]
    assert [s["secret"]["name"] for s in volume["projected"]["sources"]] == [PEERS, TLS_SECRET]
