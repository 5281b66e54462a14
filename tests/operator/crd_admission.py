"""Checking custom resources against a CRD's schema the way the API server does.

kubernetes-validate knows built-in kinds only; for our CRs the API server
applies schema defaults, validates the OpenAPI v3 schema and evaluates the
`x-kubernetes-validations` CEL rules. This does the same with jsonschema and
cel-python, including the Kubernetes quantity functions our rules use.
"""

from __future__ import annotations

import copy
import re
from decimal import Decimal
from typing import Any

import celpy
import jsonschema
from celpy import celtypes

_QUANTITY = re.compile(
    r"^(?P<num>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
_SCALE = {
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
}


class Quantity:
    def __init__(self, value: Decimal) -> None:
        self.value = value


def _quantity_value(text: str) -> Decimal:
    m = _QUANTITY.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a quantity")
    suffix = m.group("suffix") or ""
    if suffix[:1] in ("e", "E"):
        return Decimal(m.group("num")) * Decimal(10) ** int(suffix[1:])
    return Decimal(m.group("num")) * _SCALE.get(suffix, Decimal(1))


def _is_quantity(value: Any) -> celtypes.BoolType:
    return celtypes.BoolType(bool(_QUANTITY.match(str(value))))


def _quantity(value: Any) -> Quantity:
    return Quantity(_quantity_value(str(value)))


def _is_greater_than(a: Quantity, b: Quantity) -> celtypes.BoolType:
    return celtypes.BoolType(a.value > b.value)


FUNCTIONS = {
    "isQuantity": _is_quantity,
    "quantity": _quantity,
    "isGreaterThan": _is_greater_than,
}


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting: fill absent properties that have a `default`, recursively."""
    if isinstance(obj, dict):
        props = schema.get("properties", {})
        for key, sub in props.items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = apply_defaults(sub, obj[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in obj:
                if key not in props:
                    obj[key] = apply_defaults(extra, obj[key])
    elif isinstance(obj, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in obj]
    return obj


def cel_errors(schema: dict[str, Any], obj: Any, path: str = "") -> list[str]:
    """Messages of every failing `x-kubernetes-validations` rule, with the field path."""
    errors: list[str] = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]), functions=FUNCTIONS)
        try:
            ok = bool(program.evaluate({"self": celpy.json_to_cel(obj)}))
        except (celpy.CELEvalError, ValueError):
            ok = False
        if not ok:
            errors.append(f"{path + rule.get('fieldPath', '') or '.'}: {rule['message']}")
    if isinstance(obj, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in obj:
                errors += cel_errors(sub, obj[key], f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def admit(schema: dict[str, Any], obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the defaulted object, its errors): what the API server does on create."""
    defaulted = apply_defaults(schema, copy.deepcopy(obj))
    validator = jsonschema.Draft4Validator(schema)
    errors = [
        f".{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(defaulted)
    ]
    errors += cel_errors(schema, defaulted)
    return defaulted, errors
