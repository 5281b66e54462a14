"""A small, typed Kubernetes client for the kinds the operator manages.

It speaks JSON to the API server through the `kubernetes` package's
`ApiClient` (which handles kubeconfig, in-cluster tokens and TLS), with
generic paths instead of one generated class per kind. `apply()` is
create-or-merge-patch with a three-way merge against what the operator applied
last (kept in an annotation, as `kubectl apply` does): a field the operator no
longer renders is removed, a field others set is left alone, and nothing is
sent when the live object already holds every field the operator renders — so
a second reconcile is a no-op.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, cast

import kubernetes

from . import api

Manifest = dict[str, Any]

USER_AGENT = "kvpool-operator"

_PLURALS: dict[str, tuple[str, bool]] = {
    "ConfigMap": ("configmaps", True),
    "Secret": ("secrets", True),
    "Service": ("services", True),
    "ServiceAccount": ("serviceaccounts", True),
    "Pod": ("pods", True),
    "Node": ("nodes", False),
    "Namespace": ("namespaces", False),
    "Event": ("events", True),
    "DaemonSet": ("daemonsets", True),
    "Job": ("jobs", True),
    "NetworkPolicy": ("networkpolicies", True),
    "ClusterRole": ("clusterroles", False),
    "ClusterRoleBinding": ("clusterrolebindings", False),
    "PodMonitor": ("podmonitors", True),
    api.POOL_KIND: (api.POOL_PLURAL, True),
    api.POLICY_KIND: (api.POLICY_PLURAL, True),
}


_OWNED_MAPS: tuple[tuple[str, ...], ...] = (
    ("data",),
    ("spec", "template", "spec", "nodeSelector"),
)
"""Maps the operator owns entirely: keys it no longer renders are removed from live objects."""


def _dig(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def removals(live: Manifest, desired: Manifest) -> Manifest:
    """A merge patch (of `None`s) removing keys of owned maps that `desired` no longer has."""
    patch: Manifest = {}
    for path in _OWNED_MAPS:
        live_map = _dig(live, path)
        if not isinstance(live_map, Mapping):
            continue
        desired_map = _dig(desired, path)
        if not isinstance(_dig(desired, path[:-1]), Mapping):
            continue  # the parent is not rendered at all: not ours to trim
        gone = [k for k in live_map if not isinstance(desired_map, Mapping) or k not in desired_map]
        if not gone:
            continue
        node = patch
        for key in path[:-1]:
            node = node.setdefault(key, {})
        if isinstance(desired_map, Mapping):
            node[path[-1]] = {k: None for k in gone}
        else:
            node[path[-1]] = None
    return patch


LAST_APPLIED = "kvpool.io/last-applied-configuration"
"""Annotation holding what the operator last applied to an object (as `kubectl apply` keeps
`kubectl.kubernetes.io/last-applied-configuration`): the base of the three-way merge."""


def last_applied(live: Manifest) -> Manifest | None:
    """What the operator last applied to `live`, if it recorded it."""
    text = ((live.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def deletions(last: Mapping[str, Any], desired: Mapping[str, Any], live: Any) -> Manifest:
    """A merge patch (of `None`s) removing what the operator applied before (`last`), no
    longer renders (`desired`), and `live` still has: the three-way part of an apply.

    Maps are compared key by key; a list or a value that changed is in `desired` and is
    replaced whole by the patch. Fields the operator never set (server defaults, other
    controllers' fields) are not in `last`, so they are left alone.
    """
    patch: Manifest = {}
    if not isinstance(live, Mapping):
        return patch
    for key, before in last.items():
        if key not in live:
            continue
        if key not in desired:
            patch[key] = None
        elif isinstance(before, Mapping) and isinstance(desired[key], Mapping):
            nested = deletions(before, desired[key], live[key])
            if nested:
                patch[key] = nested
    return patch


def missing(live: Any, initial: Mapping[str, Any]) -> Manifest:
    """The part of `initial` that `live` lacks (maps compared key by key)."""
    if not isinstance(live, Mapping):
        return copy.deepcopy(dict(initial))
    out: Manifest = {}
    for key, value in initial.items():
        if key not in live:
            out[key] = copy.deepcopy(value)
        elif isinstance(value, Mapping):
            nested = missing(live[key], value)
            if nested:
                out[key] = nested
    return out


def with_last_applied(obj: Manifest) -> Manifest:
    """A copy of `obj` that records itself in the `LAST_APPLIED` annotation."""
    desired = copy.deepcopy(obj)
    record = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    desired["metadata"].setdefault("annotations", {})[LAST_APPLIED] = record
    return desired


def _merge(base: Manifest, extra: Manifest) -> Manifest:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def _status_message(body: Any) -> str:
    """The `message` of a Kubernetes Status response body, if there is one."""
    try:
        data = json.loads(body) if isinstance(body, str | bytes) else None
    except ValueError:
        return ""
    if isinstance(data, dict):
        return str(data.get("message") or "")
    return ""


def _loggable(kind: str) -> bool:
    """Whether the client may log the bodies of responses about `kind` (at DEBUG, as it does
    every body it parses): never a Secret's, whose values must reach no log."""
    return kind != "Secret"


class KubeError(Exception):
    """An API call failed; `status` is the HTTP status (0 when there was no response)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class Applied(StrEnum):
    CREATED = "created"
    PATCHED = "patched"
    UNCHANGED = "unchanged"


def path_of(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    """The REST path of a kind (collection) or one object."""
    try:
        plural, namespaced = _PLURALS[kind]
    except KeyError:
        raise KubeError(f"unknown kind {kind}") from None
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespaced:
        if not namespace:
            raise KubeError(f"{kind} {name} needs a namespace")
        base += f"/namespaces/{namespace}"
    path = f"{base}/{plural}"
    return f"{path}/{name}" if name else path


def contains(live: Any, desired: Any) -> bool:
    """Whether `live` already holds every field of `desired` (lists: same length, itemwise).

    The API server adds defaults (e.g. `imagePullPolicy`, `terminationMessagePath`), so
    equality would always fail; a merge patch with `desired` would change nothing exactly
    when this is true.
    """
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(
            k in live and contains(live[k], v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(contains(a, b) for a, b in zip(live, desired, strict=True))
        )
    if isinstance(desired, bool) or isinstance(live, bool):
        return live is desired
    return bool(live == desired)


@dataclass
class Kube:
    """Typed calls on one API server."""

    client: kubernetes.client.ApiClient

    @classmethod
    def from_environment(cls, user_agent: str = USER_AGENT) -> Kube:
        """In-cluster service account, else the local kubeconfig."""
        config = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=config)
        return cls._with_agent(config, user_agent)

    @classmethod
    def for_url(cls, url: str, *, verify_ssl: bool = True, user_agent: str = USER_AGENT) -> Kube:
        config = kubernetes.client.Configuration()
        config.host = url
        config.verify_ssl = verify_ssl
        return cls._with_agent(config, user_agent)

    @classmethod
    def _with_agent(cls, config: kubernetes.client.Configuration, user_agent: str) -> Kube:
        client = kubernetes.client.ApiClient(config)
        # Names the operator in the API server's audit log (kopf's own calls say "kopf/...").
        client.user_agent = user_agent
        return cls(client)

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
        *,
        log_body: bool = True,
    ) -> Manifest:
        """One API call. `log_body=False`: the client does not log the response body at
        DEBUG (as it does every body it parses): for Secrets."""
        try:
            data = self.client.call_api(
                path,
                method,
                query_params=query or [],
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body,
                response_types_map={200: "object", 201: "object", 202: "object"},
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _preload_content=log_body,
                _request_timeout=30,
            )
            if not log_body:
                raw = data
                try:
                    data = json.loads(raw.data or b"{}")
                finally:
                    raw.release_conn()
        except kubernetes.client.exceptions.ApiException as e:
            detail = _status_message(e.body)
            message = f"{method} {path}: {e.status} {e.reason}" + (f": {detail}" if detail else "")
            raise KubeError(message, e.status or 0) from e
        except OSError as e:  # urllib3 wraps most transport errors into OSError subclasses
            raise KubeError(f"{method} {path}: {e}") from e
        return cast(Manifest, data or {})

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Manifest | None:
        try:
            return self._call(
                "GET", path_of(api_version, kind, namespace, name), log_body=_loggable(kind)
            )
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def secret_keys(self, namespace: str, name: str) -> set[str] | None:
        """The keys of a Secret, or None if there is none. Its values are neither returned
        nor logged: the operator only checks that the keys it references exist."""
        try:
            data = self._call("GET", path_of("v1", "Secret", namespace, name), log_body=False)
        except KubeError as e:
            if e.status == 404:
                return None
            raise
        return set(data.get("data") or {}) | set(data.get("stringData") or {})

    def list(
        self, api_version: str, kind: str, namespace: str | None, labels: Mapping[str, str] = {}
    ) -> list[Manifest]:
        """Objects of a kind, filtered by labels here too (some servers ignore selectors)."""
        query = []
        if labels:
            query.append(("labelSelector", ",".join(f"{k}={v}" for k, v in labels.items())))
        data = self._call("GET", path_of(api_version, kind, namespace), query=query)
        items = cast(list[Manifest], data.get("items") or [])
        return [
            i
            for i in items
            if all(
                ((i.get("metadata") or {}).get("labels") or {}).get(k) == v
                for k, v in labels.items()
            )
        ]

    def create(self, obj: Manifest) -> Manifest:
        meta = obj["metadata"]
        path = path_of(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        return self._call("POST", path, body=obj, log_body=_loggable(obj["kind"]))

    def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        patch: Manifest,
        subresource: str | None = None,
    ) -> Manifest:
        """A JSON merge patch (lists are replaced; `None` removes a key)."""
        path = path_of(api_version, kind, namespace, name)
        if subresource:
            path += f"/{subresource}"
        return self._call(
            "PATCH",
            path,
            body=patch,
            content_type="application/merge-patch+json",
            log_body=_loggable(kind),
        )

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str,
               propagation: str = "Background") -> bool:
        """Delete (dependents in the background, or first with `Foreground`: the object
        stays until they are gone); False if it was already gone."""
        try:
            self._call(
                "DELETE",
                path_of(api_version, kind, namespace, name),
                body={"propagationPolicy": propagation},
                log_body=_loggable(kind),
            )
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return True

    def apply(self, obj: Manifest, initial: Manifest | None = None) -> Applied:
        """Create, or three-way merge: patch the fields that differ and remove those the
        operator set before (its `LAST_APPLIED` annotation) and no longer renders;
        nothing if there is nothing to do.

        `initial`: fields the object is created with and given only where the live object
        lacks them, never replaced (a Secret's generated value, which a later render must
        not change); they are not recorded as applied.
        """
        meta = obj["metadata"]
        ident = (obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        desired = with_last_applied(obj)
        live = self.get(*ident)
        if live is None:
            try:
                self.create(_merge(copy.deepcopy(desired), copy.deepcopy(initial or {})))
                return Applied.CREATED
            except KubeError as e:
                if e.status != 409:
                    raise
                live = self.get(*ident) or {}
        lacking = missing(live, initial or {})
        # Objects applied before the annotation existed; an owned map holding initial
        # fields (a Secret's `data`) keeps them.
        trim = removals(live, _merge(copy.deepcopy(desired), copy.deepcopy(initial or {})))
        previous = last_applied(live)
        if previous is not None:
            _merge(trim, deletions(previous, obj, live))
        if contains(live, desired) and not trim and not lacking:
            return Applied.UNCHANGED
        self.patch(*ident, _merge(_merge(desired, trim), lacking))
        return Applied.PATCHED
