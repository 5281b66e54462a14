"""The operator run by kopf against kmock's stateful Kubernetes emulator, on loopback.

`Emulator` adds what our tests rely on and kmock leaves out: `uid`,
`creationTimestamp`, and `metadata.generation` bumped on spec changes. The
operator runs in its own thread with its own event loop (kopf cancels foreign
tasks of the loop it runs in); the test's loop keeps serving the emulator.
Tests talk to the emulator over HTTP (via threads, never blocking the loop)
and wait with bounded polling.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import json
import re
import ssl
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import aiohttp.web
import jsonpatch
import kmock
import kmock._internal.parsing as _kmock_parsing
import kopf
from op_support import NAMESPACE, condition

from kvpool.bench.local import free_port
from kvpool.operator import api
from kvpool.operator.kube import Kube
from kvpool.operator.render import Names, Settings
from kvpool.operator.run import OperatorOptions, operate

T = TypeVar("T")


def _merge_patch(base: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as the emulator applies it."""
    if not isinstance(patch, dict):
        return patch
    out = dict(base) if isinstance(base, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out


def _parse_path(path: str) -> Any:
    """kmock's path parser, plus the Namespace kind's own paths.

    kmock reads `/api/v1/namespaces` and `/api/v1/namespaces/<name>` as the start of a
    namespaced path and fails (500) or finds no resource, so kopf could never list or
    watch namespaces to expand a `--namespace` pattern. Those two forms name Namespace
    objects; every longer path is namespaced, as kmock reads it.
    """
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        name = parts[3] if len(parts) == 4 else None
        return _kmock_parsing.ParsedPath("", "v1", "namespaces", None, name, None)
    return _kmock_parse_path(path)


_kmock_parse_path = _kmock_parsing.parse_path
_kmock_parsing.parse_path = _parse_path

TEST_USER_AGENT = "kvpool-tests"
"""The tests' own client: its requests are neither recorded as the operator's nor faulted."""


@dataclass(frozen=True)
class Call:
    """One request of the operator (kopf or its `Kube` client) to the emulator."""

    verb: str
    """The RBAC verb: get, list, watch, create, patch, update, delete."""
    group: str
    resource: str
    """The plural, with `/subresource` when there is one (as in an RBAC rule)."""
    namespace: str | None
    name: str | None
    user_agent: str
    at: float = 0.0
    """time.monotonic() when it arrived."""


def rbac_verb(method: str, action: Any, name: str | None, params: Any) -> str:
    """The RBAC verb the API server would authorize a request as."""
    if method == "GET":
        if str(params.get("watch", "")).lower() in ("true", "1"):
            return "watch"
        return "get" if name else "list"
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(
        method, method.lower()
    )


def _status_response(code: int, reason: str, message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        },
        status=code,
    )


@dataclass
class Fault:
    """Answer the operator's next `times` matching requests with an error instead."""

    verb: str
    resource: str
    """Plural, with `/subresource` if any."""
    status: int
    times: int
    reason: str = ""
    hits: int = 0

    def matches(self, call: Call) -> bool:
        return self.hits < self.times and (call.verb, call.resource) == (self.verb, self.resource)

    def response(self, call: Call) -> aiohttp.web.Response:
        self.hits += 1
        reason = self.reason or {409: "Conflict", 500: "InternalError"}.get(self.status, "Error")
        message = (
            f"Operation cannot be fulfilled on {call.resource} {call.name!r}: the object has "
            "been modified; please apply your changes to the latest version and try again"
            if self.status == 409
            else f"injected {self.status} for {call.verb} {call.resource}"
        )
        return _status_response(self.status, reason, message)


_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAMED = {"services", "namespaces"}
"""Kinds whose names must be DNS-1035 labels (no dots, at most 63 characters); every other
kind the operator creates takes a DNS-1123 subdomain (at most 253)."""


def name_problem(plural: str, name: str) -> str | None:
    """Why the API server would refuse `name` for a new object of `plural`, or None."""
    if plural in _LABEL_NAMED:
        if len(name) > 63 or not _DNS_LABEL.match(name):
            return "a DNS-1035 label must consist of lower case alphanumeric characters or '-'"
    elif len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        return "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters"
    return None


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator with uids, creation timestamps, spec generations and name checks.

    A namespace put in `terminating` refuses new objects the way a namespace being
    deleted does (403, "... because it is being terminated"). Every resource request
    that is not the tests' own is recorded in `calls`; `faults` turn matching ones into
    errors, and `watch_cuts` ends that many watch streams after their first event (a
    dropped connection, as an API server restart or a load balancer's idle timeout).
    """

    terminating: set[str]
    generations = True
    """Emulate metadata.generation (kmock itself has none)."""

    @property
    def calls(self) -> list[Call]:
        if not hasattr(self, "_calls"):
            self._calls: list[Call] = []
        return self._calls

    @property
    def faults(self) -> list[Fault]:
        if not hasattr(self, "_faults"):
            self._faults: list[Fault] = []
        return self._faults

    watch_cuts = 0
    watches_cut = 0

    def _record(self, request: Any) -> Call | None:
        user_agent = str(request.headers.get("User-Agent", ""))
        if request.resource is None or user_agent.startswith(TEST_USER_AGENT):
            return None
        if not request.resource.plural:
            return None  # discovery (/apis/<group>/<version>): readable by every user
        resource = request.resource.plural
        if request.subresource:
            resource += f"/{request.subresource}"
        call = Call(
            verb=rbac_verb(
                str(getattr(request.method, "value", request.method)),
                request.action,
                request.name,
                request.params,
            ),
            group=request.resource.group or "",
            resource=resource,
            namespace=request.namespace,
            name=request.name,
            user_agent=user_agent,
            at=time.monotonic(),
        )
        self.calls.append(call)
        return call

    async def _serve_watch(self, request: Any) -> Any:
        events = 0
        async for item in super()._serve_watch(request):
            yield item
            if isinstance(item, dict):
                events += 1
            if events and self.watches_cut < self.watch_cuts:
                self.watches_cut += 1
                return  # the stream ends: kopf must notice and watch again

    REQUEST_LOG = 2
    """Requests kmock keeps in its log. It finds the reaction for each new request by running
    every reaction's filter over the whole log (quadratic: at 50 kept, the 100-pool test spent
    two minutes there, at 2 a few seconds). No test reads the log (they use `calls` and
    `objects`), and the request being matched is always the newest."""

    async def _handle(self, request: Any) -> Any:
        if len(self._requests) > 2 * self.REQUEST_LOG:
            del self._requests[: -self.REQUEST_LOG]
        call = self._record(request)
        if call is not None:
            for fault in self.faults:
                if fault.matches(call):
                    return fault.response(call)
        terminating = getattr(self, "terminating", set())
        if (
            request.resource is not None
            and request.action == kmock.action.CREATE
            and request.namespace in terminating
        ):
            message = (
                f"{request.resource.plural} is forbidden: unable to create new content in "
                f"namespace {request.namespace} because it is being terminated"
            )
            return _status_response(403, "Forbidden", message)
        if request.resource is not None and isinstance(request.data, dict):
            if request.action == kmock.action.CREATE:
                meta = request.data.setdefault("metadata", {})
                # The API server refuses names invalid for the kind (kmock takes any);
                # an object with only a generateName (kopf's Events) gets one made.
                name = meta.get("name")
                problem = name_problem(request.resource.plural, str(name)) if name else None
                if problem is not None:
                    return _status_response(
                        422,
                        "Invalid",
                        f"{request.resource.plural} {meta.get('name')!r} is invalid: "
                        f"metadata.name: {problem}",
                    )
                meta.setdefault("uid", str(uuid.uuid4()))
                if self.generations:
                    meta.setdefault("generation", 1)
                # kopf guards some JSON patches with a `test` of resourceVersion; kmock keeps
                # none. A constant one lets those tests pass (no conflicts are emulated).
                meta.setdefault("resourceVersion", "1")
                meta.setdefault(
                    "creationTimestamp",
                    datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                )
            elif (
                self.generations
                and request.action == kmock.action.UPDATE
                and request.name is not None
                and not request.subresource
                and "spec" in request.data
            ):
                key = (request.resource, request.namespace, request.name)
                if key in self.objects and not self.objects[key].deleted:
                    old = copy.deepcopy(self.objects[key].raw)
                    new = _merge_patch(copy.deepcopy(old), {"spec": request.data["spec"]})
                    if new.get("spec") != old.get("spec"):
                        generation = int(old.get("metadata", {}).get("generation") or 1) + 1
                        request.data.setdefault("metadata", {})["generation"] = generation
        return await super()._handle(request)


class EmulatorWithoutGenerations(Emulator):
    """As kmock ships: no metadata.generation on any object."""

    generations = False


def declare_resources(emulator: kmock.KubernetesEmulator) -> None:
    emulator.resources.load_bundled()
    verbs = {"create", "delete", "get", "list", "patch", "update", "watch"}
    for plural, kind in ((api.POOL_PLURAL, api.POOL_KIND), (api.POLICY_PLURAL, api.POLICY_KIND)):
        emulator.resources[f"{api.GROUP}/{api.VERSION}/{plural}"] = kmock.ResourceInfo(
            kind=kind,
            singular=kind.lower(),
            namespaced=True,
            verbs=verbs,
            subresources={"status"},
        )


@dataclass
class Cluster:
    """The emulator, a client for it, and the running operator."""

    emulator: kmock.KubernetesEmulator
    kube: Kube
    webhook_url: str
    options: OperatorOptions
    """What the operator runs with: the tests' options (`options_for_tests`) until started
    with others."""
    thread: threading.Thread | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[BaseException] = field(default_factory=list)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """A blocking client call, off the loop that serves the emulator."""
        return await asyncio.to_thread(fn, *args)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.call(self.kube.create, obj)

    async def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = NAMESPACE
    ) -> dict[str, Any] | None:
        return await self.call(self.kube.get, api_version, kind, namespace, name)

    async def patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        patch: dict[str, Any],
        subresource: str | None = None,
        namespace: str = NAMESPACE,
    ) -> None:
        await self.call(self.kube.patch, api_version, kind, namespace, name, patch, subresource)

    async def delete(
        self, api_version: str, kind: str, name: str, namespace: str = NAMESPACE
    ) -> None:
        await self.call(self.kube.delete, api_version, kind, namespace, name)

    async def edit_pool(self, name: str, spec: dict[str, Any]) -> None:
        """Merge `spec` into the pool's, as `kubectl patch --type merge` stores it (the
        emulator runs no admission webhook: an edit they would refuse is stored too)."""
        await self.patch(api.API_VERSION, api.POOL_KIND, name, {"spec": spec})

    async def edit_policy(self, name: str, spec: dict[str, Any]) -> None:
        """Merge `spec` into the KVTierPolicy's, as `edit_pool` does."""
        await self.patch(api.API_VERSION, api.POLICY_KIND, name, {"spec": spec})

    async def pool(self, name: str) -> dict[str, Any] | None:
        return await self.get(api.API_VERSION, api.POOL_KIND, name)

    async def report_agents(
        self, daemon_set: str, desired: int, ready: int, updated: int, available: int
    ) -> None:
        """Write the DaemonSet's status as its controller would, having observed its
        current generation."""
        ds = await self.get("apps/v1", "DaemonSet", daemon_set)
        assert ds is not None, f"no DaemonSet {daemon_set}"
        status: dict[str, Any] = {
            "desiredNumberScheduled": desired,
            "numberReady": ready,
            "updatedNumberScheduled": updated,
            "numberAvailable": available,
        }
        generation = ds["metadata"].get("generation")
        if generation is not None:
            status["observedGeneration"] = generation
        await self.patch("apps/v1", "DaemonSet", daemon_set, {"status": status}, "status")

    async def report_reclaimed(self, pool: str, nodes: int = 1) -> dict[str, Any]:
        """Wait for the reclaim DaemonSet a deleted pool's finalizer starts (the default
        `nodeReclaimPolicy: Delete`) and report it ready on `nodes` nodes, as its
        controller would once every node's directories are removed; return it."""
        name = Names(NAMESPACE, pool).reclaim
        ds = await self.eventually(lambda: self.get("apps/v1", "DaemonSet", name),
                                   f"the reclaim DaemonSet of {pool}")
        await self.report_agents(name, nodes, nodes, nodes, nodes)
        return ds

    async def condition_of(
        self, pool: str, type_: str, status: str, reason: str
    ) -> dict[str, Any]:
        """Wait until the pool's `type_` condition has this status and reason; return it."""

        async def probe() -> dict[str, Any] | None:
            c = condition(await self.pool(pool), type_)
            return c if (c.get("status"), c.get("reason")) == (status, reason) else None

        return await self.eventually(probe, f"{pool}: {type_}={status}/{reason}")

    async def admit_pod(
        self,
        pod: dict[str, Any],
        operation: str = "CREATE",
        old: dict[str, Any] | None = None,
        until: Callable[[dict[str, Any]], bool] = lambda _: True,
    ) -> dict[str, Any]:
        """The pod webhook's answer to `pod` in the operator's namespace (see `admit`)."""
        review = admission_review(pod, NAMESPACE, operation, old)
        return await self.admit("kvpool-inject", review, until=until)

    async def admit_pool(
        self, pool: dict[str, Any], operation: str = "CREATE", old: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The pool validating webhook's answer to `pool` (see `admit`)."""
        review = admission_review(pool, NAMESPACE, operation, old, username="alice")
        return await self.admit("kvpool-validate-pool", review)

    async def eventually(
        self,
        probe: Callable[[], Awaitable[T | None]],
        what: str,
        timeout: float = 60.0,
        interval: float = 0.05,
    ) -> T:
        """Poll `probe` every `interval` seconds until it returns something truthy; fail
        after `timeout` seconds (a hang guard: generous, the machine may be loaded)."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.thread is not None and not self.thread.is_alive():
                raise AssertionError(f"the operator stopped: {self.errors!r}")
            try:
                last = await probe()
            except AssertionError as e:
                last = e
            else:
                if last:
                    return last
            await asyncio.sleep(interval)
        raise AssertionError(f"timed out waiting for {what}; last: {last!r}")

    async def admit(
        self,
        webhook: str,
        review: dict[str, Any],
        ssl_context: ssl.SSLContext | None = None,
        until: Callable[[dict[str, Any]], bool] = lambda _: True,
    ) -> dict[str, Any]:
        """POST an AdmissionReview to one of the operator's webhooks, as the API server does,
        and return its response; retried while the webhook server starts, and until `until`
        accepts the answer (e.g. a pool the webhook learns of through its watch)."""

        async def post() -> dict[str, Any] | None:
            try:
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(
                        f"{self.webhook_url}/{webhook}",
                        json=review,
                        ssl=ssl_context if ssl_context is not None else True,
                        timeout=aiohttp.ClientTimeout(total=10),
                    ) as resp,
                ):
                    assert resp.status == 200, await resp.text()
                    response: dict[str, Any] = (await resp.json())["response"]
            except aiohttp.ClientConnectorError:
                return None  # the webhook server is still starting
            return response if until(response) else None

        return await self.eventually(post, f"the answer of webhook {webhook}")

    @contextlib.asynccontextmanager
    async def running(self, options: OperatorOptions | None = None) -> AsyncIterator[Cluster]:
        """The operator runs (with `options`, by default the tests' own) inside the block;
        stopped, bounded, at its end."""
        self.start(options or self.options)
        try:
            await self.wait_ready()
            yield self
        finally:
            await self.shutdown()

    def start(self, options: OperatorOptions) -> None:
        self.options = options
        ready = threading.Event()
        url = str(self.emulator.url).rstrip("/")
        connection = kopf.ConnectionInfo(server=url, insecure=True)
        # The operator's own client, apart from the tests' (`self.kube`): its requests are
        # the ones recorded and faulted.
        operator_kube = Kube.for_url(url)

        def main() -> None:
            try:
                asyncio.run(
                    operate(
                        options,
                        operator_kube,
                        connection=connection,
                        ready_flag=ready,
                        stop_flag=self.stop,
                    )  # type: ignore[arg-type]
                )
            except BaseException as e:  # surfaced by eventually() and stop()
                self.errors.append(e)

        self.thread = threading.Thread(target=main, name="kvpool-operator", daemon=True)
        self.thread.start()
        self._ready = ready

    async def wait_ready(self, timeout: float = 20.0) -> None:
        ok = await asyncio.to_thread(self._ready.wait, timeout)
        assert ok, f"the operator did not start: {self.errors!r}"

    async def shutdown(self, timeout: float = 20.0) -> None:
        self.stop.set()
        if self.thread is not None:
            await asyncio.to_thread(self.thread.join, timeout)
            assert not self.thread.is_alive(), "the operator did not stop"

    async def restart(self) -> None:
        """Stop the operator and start a new one with the same options (webhook port
        included): it knows only what the cluster stores, nothing of the first one's memory."""
        await self.shutdown()
        self.stop = threading.Event()
        self.start(self.options)
        await self.wait_ready()


def cluster_on(emulator: kmock.KubernetesEmulator, https: bool = False) -> Cluster:
    """The emulator with kvpool's resources, and an operator not started yet, its webhook
    on a free port (TLS with `https`: give it a certificate directory in its options)."""
    declare_resources(emulator)
    port = free_port()
    return Cluster(
        emulator=emulator,
        kube=client_for_tests(str(emulator.url)),
        webhook_url=f"{'https' if https else 'http'}://127.0.0.1:{port}",
        options=options_for_tests(port),
    )


def admission_review(
    obj: dict[str, Any],
    namespace: str,
    operation: str = "CREATE",
    old: dict[str, Any] | None = None,
    username: str = "system:serviceaccount:kube-system:replicaset-controller",
) -> dict[str, Any]:
    """The AdmissionReview the API server sends for `obj` (a Pod or one of kvpool's kinds).
    The namespace is the request's: a pod made by a controller has none in its metadata."""
    if obj["kind"] == "Pod":
        group, version, resource = "", "v1", "pods"
    else:
        plural = api.POOL_PLURAL if obj["kind"] == api.POOL_KIND else api.POLICY_PLURAL
        group, version, resource = api.GROUP, api.VERSION, plural
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": group, "version": version, "kind": obj["kind"]},
            "resource": {"group": group, "version": version, "resource": resource},
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": username},
            # A DELETE carries the object being deleted as the old one, and no new one.
            "object": None if operation == "DELETE" else obj,
            "oldObject": obj if operation == "DELETE" else old,
            "dryRun": False,
        },
    }


def pool_known(response: dict[str, Any]) -> bool:
    """Whether the pod webhook's answer comes from an index that holds the pool (an
    operator that just started may not have listed it yet): `until` of `Cluster.admit`."""
    return bool(response["allowed"]) or "not found" not in response["status"]["message"]


def patched(obj: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    """`obj` as a mutating webhook's allowed `response` (base64 JSON patch) leaves it."""
    assert response["allowed"] is True, response
    ops = json.loads(base64.b64decode(response["patch"]))
    result: dict[str, Any] = jsonpatch.apply_patch(copy.deepcopy(obj), ops)
    return result


def client_for_tests(url: str) -> Kube:
    """A client for the tests' own requests (not recorded, not faulted)."""
    return Kube.for_url(url.rstrip("/"), user_agent=TEST_USER_AGENT)


def options_for_tests(webhook_port: int) -> OperatorOptions:
    return OperatorOptions(
        namespaces=[NAMESPACE],
        metrics_port=0,
        liveness_port=0,
        webhook_port=webhook_port,
        webhook_insecure=True,
        webhook_addr="127.0.0.1",
        settings=Settings(agent_image="ghcr.io/kvpool/kvpool:test", version="test"),
        resync_seconds=0,
        retry_delay=0.5,
        retry_max=2.0,
        gc_poll=0.2,
    )
