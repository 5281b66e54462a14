"""`docs/crd-reference.md`, generated from the same schemas as the CRDs.

Regenerate with `python -m kvpool.operator.reference docs/crd-reference.md`;
a test fails when the committed file differs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from . import crds

Schema = dict[str, Any]

HEADER = """\
# CRD reference

Generated from the operator's models by `python -m kvpool.operator.reference
docs/crd-reference.md` — do not edit by hand. Group `kvpool.io`, version
`v1alpha1`, both kinds namespaced. Sizes are Kubernetes quantities (`512Mi`,
`8Gi`, `1Ti`, or a number of bytes); durations are numbers of seconds or
strings such as `500ms`, `30s`, `5m`, `2h`, `7d`. The API server applies the
defaults shown and enforces the validation rules listed under each kind.
Examples: [`examples/pool.yaml`](examples/pool.yaml),
[`examples/pool-minimal.yaml`](examples/pool-minimal.yaml),
[`examples/policy.yaml`](examples/policy.yaml).
"""


def _type(node: Schema) -> str:
    if node.get("x-kubernetes-int-or-string"):
        rules = " ".join(r["rule"] for r in node.get("x-kubernetes-validations", []))
        return "quantity" if "isQuantity" in rules else "duration"
    kind = node.get("type", "")
    if kind == "array":
        return f"list of {_type(node['items'])}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of {_type(node['additionalProperties'])}"
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    return str(kind)


def _bounds(node: Schema) -> str:
    parts = []
    if "minimum" in node:
        op = ">" if node.get("exclusiveMinimum") else "≥"
        parts.append(f"{op} {node['minimum']}")
    if "maximum" in node:
        op = "<" if node.get("exclusiveMaximum") else "≤"
        parts.append(f"{op} {node['maximum']}")
    if "minLength" in node:
        parts.append(f"length ≥ {node['minLength']}")
    if "maxLength" in node:
        parts.append(f"length ≤ {node['maxLength']}")
    if "maxItems" in node:
        parts.append(f"at most {node['maxItems']} items")
    if "pattern" in node:
        parts.append(f"pattern `{node['pattern']}`")
    return ", ".join(parts)


def _default(node: Schema) -> str:
    if "default" not in node:
        return ""
    value = node["default"]
    if isinstance(value, dict) and len(json.dumps(value)) > 40:
        return "(see fields)"
    return f"`{json.dumps(value)}`"


def _rows(node: Schema, prefix: str, required: bool, out: list[str], rules: list[str]) -> None:
    if prefix:
        desc = " ".join(str(node.get("description", "")).split())
        bounds = _bounds(node)
        if bounds:
            desc = f"{desc} ({bounds})" if desc else bounds
        desc = desc.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
        req = "yes" if required else ""
        out.append(f"| `{prefix}` | {_type(node)} | {req} | {_default(node)} | {desc} |")
    for rule in node.get("x-kubernetes-validations", []):
        where = prefix or "(object)"
        rules.append(f"- `{where}`: `{rule['rule']}` — {rule['message']}")
    child = node
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        child = node["items"]
        prefix = f"{prefix}[]"
        for rule in child.get("x-kubernetes-validations", []):
            rules.append(f"- `{prefix}`: `{rule['rule']}` — {rule['message']}")
    elif isinstance(node.get("additionalProperties"), dict):
        child = node["additionalProperties"]
        prefix = f"{prefix}.*"
    needed = set(child.get("required", []))
    for key, sub in child.get("properties", {}).items():
        _rows(sub, f"{prefix}.{key}" if prefix else key, key in needed, out, rules)


def _section(title: str, node: Schema) -> list[str]:
    rows: list[str] = []
    rules: list[str] = []
    _rows(node, "", False, rows, rules)
    lines = [f"### {title}", ""]
    doc = " ".join(str(node.get("description", "")).split())
    if doc:
        lines += [doc, ""]
    lines += [
        "| field | type | required | default | description |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]
    if rules:
        lines += ["Validation rules (CEL, enforced by the API server):", "", *rules, ""]
    return lines


def render_reference() -> str:
    lines = [HEADER]
    for crd in crds.crds():
        names = crd["spec"]["names"]
        version = crd["spec"]["versions"][0]
        root = version["schema"]["openAPIV3Schema"]
        lines += [
            f"## {names['kind']}",
            "",
            " ".join(root["description"].split()),
            "",
            f"`kubectl get {names['plural']}` (short names: "
            + ", ".join(f"`{s}`" for s in names["shortNames"])
            + ") shows: "
            + ", ".join(c["name"] for c in version["additionalPrinterColumns"])
            + ".",
            "",
        ]
        lines += _section("spec", root["properties"]["spec"])
        lines += _section("status", root["properties"]["status"])
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    text = render_reference()
    if args:
        Path(args[0]).write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
