"""CustomResourceDefinitions generated from the API models.

`crds()` walks the pydantic models of `kvpool.operator.api` (and the agent's
`TierPolicy`) into structural OpenAPI v3 schemas: descriptions and defaults
from the fields, bounds and patterns from their constraints, sizes and
durations as int-or-string, and `x-kubernetes-validations` CEL rules for the
checks that span fields. The committed `crds/*.yaml`, the chart's copy and
`docs/crd-reference.md` are all generated from here (`kvpool crds`).
"""

from __future__ import annotations

import enum
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo

from kvpool.agent.config import TENANT_NAME_PATTERN, Events, TenantPolicy, TierPolicy, TierRules
from kvpool.agent.units import parse_duration, parse_size

from . import api

Schema = dict[str, Any]

SIZE_RULE = (
    "type(self) == int ? self > 0 : isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))"
)
DURATION_RULE = (
    "type(self) == int ? self > 0 : "
    "self.matches('^[0-9]+(\\\\.[0-9]+)?(ms|s|m|h|d)?$') && !self.matches('^[0.]+[a-z]*$')"
)

# Object-level CEL rules (cross-field checks), by model.
_RULES: dict[type[BaseModel], list[Schema]] = {
    TierRules: [
        {
            "rule": "self.lowWatermark < self.highWatermark",
            "message": "lowWatermark must be below highWatermark",
            "fieldPath": ".lowWatermark",
        }
    ],
    api.TiersSpec: [
        {
            "rule": "has(self.dram) || has(self.nvme) || has(self.shared)",
            "message": "at least one tier (dram, nvme or shared) is required",
        }
    ],
    Events: [
        {
            "rule": "!has(self.replayPort) || !has(self.port) || self.replayPort != self.port",
            "message": "replayPort must differ from port",
            "fieldPath": ".replayPort",
        }
    ],
    api.KVCachePoolSpec: [
        {
            # The agent container's ports must be distinct (as api.port_conflict checks).
            "rule": "!has(self.events) || !has(self.events.enabled) || !self.events.enabled"
            " || !has(self.agent) || !has(self.agent.metricsPort)"
            " || ((!has(self.events.port) || self.events.port != self.agent.metricsPort)"
            " && (!has(self.events.replayPort)"
            " || self.events.replayPort != self.agent.metricsPort))",
            "message": "events.port and events.replayPort must differ from agent.metricsPort",
            "fieldPath": ".events",
        },
        {
            # The peer port, too (as api.port_conflict checks); the server fills in every
            # default before the rule runs, but a `has` keeps the rule safe without them.
            "rule": "!has(self.peers) || !has(self.peers.enabled) || !self.peers.enabled"
            " || !has(self.peers.port)"
            " || ((!has(self.agent) || !has(self.agent.metricsPort)"
            " || self.peers.port != self.agent.metricsPort)"
            " && (!has(self.events) || !has(self.events.enabled) || !self.events.enabled"
            " || ((!has(self.events.port) || self.events.port != self.peers.port)"
            " && (!has(self.events.replayPort) || self.events.replayPort != self.peers.port))))",
            "message": "peers.port must differ from agent.metricsPort, events.port and "
            "events.replayPort",
            "fieldPath": ".peers.port",
        },
    ],
    api.SharedSpec: [
        {
            "rule": "!has(self.credentialsSecret) || self.url.startsWith('s3://')",
            "message": "credentialsSecret applies to s3:// URLs only",
            "fieldPath": ".credentialsSecret",
        }
    ],
}

# Per-field additions the pydantic model cannot express (list semantics, bounds).
_FIELD_EXTRA: dict[tuple[type[BaseModel], str], Schema] = {
    (TierPolicy, "tiers"): {"description": "Fill, eviction and admission rules of each tier."},
    (TierPolicy, "promotion"): {
        "description": "Copying chunks read from a slower tier up into DRAM."
    },
    (TierPolicy, "prefetch"): {
        "description": "Loading the next chunks of a prefix on a hit below DRAM."
    },
    (TierPolicy, "tenants"): {
        "description": "Per-tenant priorities and byte quotas (tenant as in the fingerprint).",
        "maxItems": 256,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
    },
    (TierPolicy, "pins"): {"maxItems": 4096, "items": {"pattern": "^[0-9a-fA-F]{32}$"}},
    (TenantPolicy, "name"): {"pattern": TENANT_NAME_PATTERN},
    (api.KVCachePoolSpec, "tolerations"): {"maxItems": 64},
    (api.KVCachePoolSpec, "tenants"): {
        "maxItems": 64,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
    },
    (api.KVCachePoolStatus, "conditions"): {
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
    },
}

# Descriptions that replace a field's own where the CRD means something else: the agent's
# config documents its YAML, where a field can be left out; in a pool, the API server
# fills in every default.
_DESCRIPTIONS: dict[tuple[type[BaseModel], str], str] = {
    (api.KVCachePoolSpec, "events"): (
        "KV events for KV-aware routers (llm-d, Dynamo): every agent publishes the chunks "
        "entering and leaving its tiers in vLLM's KV-event format (ZMQ PUB, and a ROUTER "
        "socket for replay). Enabled: the agent container gets the named ports kv-events "
        "and kv-replay, and the headless Service kvpool-<name>-events lists every ready "
        "agent's address (docs/events.md)."
    ),
    (Events, "replay_port"): (
        "TCP port of the ZMQ ROUTER replay socket, through which a late subscriber fetches "
        "the buffered batches it missed."
    ),
}


def _constraints(metadata: list[Any], schema: Schema) -> None:
    is_array = schema.get("type") == "array"
    for m in metadata:
        if isinstance(m, annotated_types.Ge):
            schema["minimum"] = m.ge
        elif isinstance(m, annotated_types.Gt):
            schema["minimum"] = m.gt
            schema["exclusiveMinimum"] = True
        elif isinstance(m, annotated_types.Le):
            schema["maximum"] = m.le
        elif isinstance(m, annotated_types.Lt):
            schema["maximum"] = m.lt
            schema["exclusiveMaximum"] = True
        elif isinstance(m, annotated_types.MinLen):
            schema["minItems" if is_array else "minLength"] = m.min_length
        elif isinstance(m, annotated_types.MaxLen):
            schema["maxItems" if is_array else "maxLength"] = m.max_length
        elif getattr(m, "pattern", None):
            schema["pattern"] = m.pattern


def _special(metadata: list[Any]) -> Schema | None:
    for m in metadata:
        func = getattr(m, "func", None)
        if func is parse_size:
            return {
                "x-kubernetes-int-or-string": True,
                # Bounds the estimated cost of the CEL rule (lists of quotas have many).
                "maxLength": 64,
                "x-kubernetes-validations": [
                    {"rule": SIZE_RULE, "message": "must be a size greater than zero, like 8Gi"}
                ],
            }
        if func is parse_duration:
            return {
                "x-kubernetes-int-or-string": True,
                "maxLength": 64,
                "x-kubernetes-validations": [
                    {
                        "rule": DURATION_RULE,
                        "message": "must be a duration greater than zero, like 30s, 5m, 1h, 7d",
                    }
                ],
            }
    return None


def _type_schema(tp: Any, metadata: list[Any]) -> Schema:
    special = _special(metadata)
    if special is not None:
        return special
    origin = get_origin(tp)
    if origin is typing.Annotated:
        inner, *more = get_args(tp)
        return _type_schema(inner, [*more, *metadata])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {tp!r}")
        return _type_schema(args[0], metadata)
    schema: Schema
    if origin is Literal:
        values = list(get_args(tp))
        schema = {"type": _json_type(type(values[0])), "enum": values}
    elif origin is list:
        (item,) = get_args(tp)
        schema = {"type": "array", "items": _type_schema(item, [])}
    elif origin is dict:
        _, value = get_args(tp)
        if value is Any:  # kept as stored: no schema of its own (a copy of a checked spec)
            schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        else:
            schema = {"type": "object", "additionalProperties": _type_schema(value, [])}
    elif isinstance(tp, type) and issubclass(tp, BaseModel):
        schema = model_schema(tp)
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        schema = {"type": "string", "enum": [m.value for m in tp]}
    else:
        schema = {"type": _json_type(tp)}
    _constraints(metadata, schema)
    return schema


def _json_type(tp: Any) -> str:
    if tp is bool:
        return "boolean"
    if tp is int:
        return "integer"
    if tp is float:
        return "number"
    if tp is str or tp is Path:
        return "string"
    raise TypeError(f"no OpenAPI type for {tp!r}")


def _default(field: FieldInfo) -> Any:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return None
    annotated: Any = field.annotation
    if field.metadata:
        annotated = typing.Annotated[(annotated, *field.metadata)]
    adapter: TypeAdapter[Any] = TypeAdapter(annotated)
    return adapter.dump_python(value, mode="json", by_alias=True, exclude_none=True)


def _doc(cls: type) -> str:
    return " ".join((cls.__doc__ or "").split())


def model_schema(cls: type[BaseModel]) -> Schema:
    """The structural OpenAPI v3 schema of a pydantic model (camelCase wire names)."""
    properties: Schema = {}
    required: list[str] = []
    for name, field in cls.model_fields.items():
        wire = field.alias or name
        schema = _type_schema(field.annotation, list(field.metadata))
        if (cls, name) in _DESCRIPTIONS:
            schema = {**schema, "description": _DESCRIPTIONS[(cls, name)]}
        elif field.description:
            schema = {"description": field.description, **schema}
        if field.is_required():
            required.append(wire)
        else:
            default = _default(field)
            if default is not None:
                schema["default"] = default
        extra = _FIELD_EXTRA.get((cls, name))
        if extra and "description" in extra and "description" not in schema:
            schema = {"description": extra["description"], **schema}
        if extra:
            for key, value in extra.items():
                if key == "description":
                    continue
                if key == "items":
                    schema["items"] = {**schema["items"], **value}
                else:
                    schema[key] = value
        properties[wire] = schema
    out: Schema = {"type": "object"}
    doc = _doc(cls)
    if doc and cls.__module__ != "pydantic.main":
        out["description"] = doc
    out["properties"] = properties
    if required:
        out["required"] = required
    if cls in _RULES:
        out["x-kubernetes-validations"] = _RULES[cls]
    return out


def _top(spec: Schema, status: Schema, description: str, spec_required: bool) -> Schema:
    root: Schema = {
        "type": "object",
        "description": description,
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    if spec_required:
        root["required"] = ["spec"]
    return root


def _crd(
    kind: str,
    plural: str,
    short: list[str],
    schema: Schema,
    columns: list[Schema],
) -> Schema:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{api.GROUP}",
            "labels": {
                "app.kubernetes.io/name": "kvpool",
                "app.kubernetes.io/part-of": "kvpool",
            },
        },
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short,
                "categories": ["kvpool"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def pool_schema() -> Schema:
    """The `openAPIV3Schema` of `KVCachePool`."""
    return _top(
        model_schema(api.KVCachePoolSpec),
        model_schema(api.KVCachePoolStatus),
        "A tiered KV-cache pool: a kvpool agent on every selected node, with DRAM, NVMe "
        "and shared-store tiers, serving inference pods annotated kvpool.io/pool.",
        spec_required=True,
    )


def policy_schema() -> Schema:
    """The `openAPIV3Schema` of `KVTierPolicy`."""
    spec = model_schema(TierPolicy)
    spec["default"] = {}
    return _top(
        spec,
        model_schema(api.KVTierPolicyStatus),
        "How the agents of the pools that reference it fill, evict, admit, promote and "
        "prefetch chunks: watermarks, eviction order, TTLs, pins and tenant quotas.",
        spec_required=False,
    )


def _age() -> Schema:
    return {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


def crds() -> list[Schema]:
    """Both CRDs, pool first."""
    ready = '.status.conditions[?(@.type=="Ready")]'
    pool = _crd(
        api.POOL_KIND,
        api.POOL_PLURAL,
        ["kvpool", "kvpools"],
        pool_schema(),
        [
            {"name": "Tiers", "type": "string", "jsonPath": ".status.tiers"},
            {"name": "Desired", "type": "integer", "jsonPath": ".status.nodes.desired"},
            {"name": "Nodes Ready", "type": "integer", "jsonPath": ".status.nodes.ready"},
            {"name": "Ready", "type": "string", "jsonPath": f"{ready}.status"},
            {"name": "Reason", "type": "string", "jsonPath": f"{ready}.reason", "priority": 1},
            {"name": "Policy", "type": "string", "jsonPath": ".spec.policyRef.name", "priority": 1},
            _age(),
        ],
    )
    policy = _crd(
        api.POLICY_KIND,
        api.POLICY_PLURAL,
        ["kvpolicy", "kvpolicies"],
        policy_schema(),
        [
            {"name": "DRAM Eviction", "type": "string", "jsonPath": ".spec.tiers.dram.eviction"},
            {"name": "Pools", "type": "string", "jsonPath": ".status.pools"},
            _age(),
        ],
    )
    return [pool, policy]


def crd_filename(crd: Schema) -> str:
    return f"{crd['metadata']['name']}.yaml"


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (ConfigMap data reads as the file it is)."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value and not value.endswith((" ", "\t")) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(obj: Any) -> str:
    """YAML as kubectl users read it: keys in order, multi-line strings as blocks."""
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)


def crds_yaml() -> str:
    """All CRDs as one multi-document YAML (what `kvpool crds` prints)."""
    return "---\n".join(to_yaml(c) for c in crds())


def write_crds(directory: Path) -> list[Path]:
    """Write one file per CRD into `directory`; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for crd in crds():
        path = directory / crd_filename(crd)
        path.write_text(to_yaml(crd))
        paths.append(path)
    return paths
