"""The operator policy: what a pool may ask of the nodes, set by the cluster admin.

Creating a `KVCachePool` makes the operator, with its cluster-wide rights, run a
DaemonSet on every selected node. Without limits that is a way for anyone who may
create a pool in one namespace to run any image as root, tolerating every taint,
with any host directory mounted. The operator policy closes that: it is set by the
chart's `operatorPolicy` values (the flags and environment of `kvpool operator` and
`kvpool render`, with the same defaults), checked by `render()` (so by the pool
admission webhook, the reconcile and `kvpool render` alike), and a pool outside it
is refused with the reason (`Forbidden`).

`check(pool, policy, default_image)` is pure: it returns nothing or raises.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

from . import api

DEFAULT_HOST_PATH_ROOTS = ("/mnt", "/data", "/var/lib/kvpool", "/run/kvpool")
"""Where pools may put host directories by default: data mounts, and the socket root."""

DENIED_HOST_PATHS = (
    "/etc",
    "/proc",
    "/sys",
    "/dev",
    "/root",
    "/boot",
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib64",
    "/var/lib/kubelet",
    "/var/run",
    "/run/containerd",
    "/var/lib/containerd",
    "/var/lib/docker",
)
"""Host directories no pool may mount, whatever the allowed roots say (nor `/` itself):
the node's configuration, kernel interfaces, binaries, the kubelet's and the container
runtimes' state (their sockets and every pod's volumes)."""


class Forbidden(api.InvalidSpec):
    """The pool asks for something the operator policy does not allow."""


@dataclass(frozen=True)
class OperatorPolicy:
    """What pools may ask for (the defaults are the chart's and the flags')."""

    allowed_images: tuple[str, ...] = ()
    """Image prefixes a pool's `spec.agent.image` may start with: a repository
    (`ghcr.io/kvpool/kvpool`: any tag or digest of it) or a prefix ending in `/`
    (`registry.example.com/ml/`: any image below it). Empty: the repository of the
    operator's agent image only."""
    allow_root: bool = False
    """Whether `spec.agent.runAsUser: 0` is allowed."""
    host_path_roots: tuple[str, ...] = DEFAULT_HOST_PATH_ROOTS
    """Directories below which `nvme.hostPath`, a `file://` shared URL, `socketDir` and
    `stateHostPath` may lie."""
    allow_tolerate_all_taints: bool = False
    """Whether a toleration without a key and with `operator: Exists` (one that matches
    every taint) is allowed."""
    allow_events: bool = True
    """Whether pools may publish KV events (`spec.events.enabled`): an unauthenticated port
    on every agent from which anyone on the pod network reads the token ids of cached
    prompt prefixes."""
    allow_peers: bool = True
    """Whether pools may run the peer tier (`spec.peers.enabled`): their agents serve chunks
    to each other on the pod network. Allowed by default: it asks nothing of the nodes,
    every connection proves the pool's own secret and a NetworkPolicy admits only the
    pool's agents; an admin refuses it where KV bytes must not cross the pod network
    (unencrypted without `spec.peers.tls`, or a network that enforces no NetworkPolicy)."""


def image_repository(image: str) -> str:
    """`image` without its tag or digest (`ghcr.io/kvpool/kvpool:1.0`: `ghcr.io/kvpool/kvpool`)."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


def image_allowed(image: str, prefixes: Iterable[str]) -> bool:
    """Whether `image` is one of the repositories, or lies below a prefix ending in `/`."""
    for prefix in prefixes:
        if prefix.endswith("/"):
            if image.startswith(prefix):
                return True
        elif image_repository(image) == prefix:
            return True
    return False


def normalize_host_path(path: str) -> str:
    """The absolute, normalized form of a host path; `ValueError` if it is relative or has `..`."""
    if not path.startswith("/"):
        raise ValueError("must be an absolute path")
    if ".." in path.split("/"):
        raise ValueError("must not contain '..'")
    return posixpath.normpath("/" + path.lstrip("/"))  # POSIX keeps a leading "//"


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def host_path_problem(path: str, roots: Iterable[str]) -> str | None:
    """Why a pool may not use host directory `path`, or None."""
    try:
        normal = normalize_host_path(path)
    except ValueError as e:
        return f"{path!r} {e}"
    if normal == "/" or any(_under(normal, denied) for denied in DENIED_HOST_PATHS):
        return f"{path!r} is a system directory no pool may mount"
    roots = list(roots)
    if not any(_under(normal, normalize_host_path(root)) for root in roots):
        return f"{path!r} is not below an allowed host path root ({', '.join(roots) or 'none'})"
    return None


def _shared_file_path(pool: api.KVCachePool) -> str | None:
    shared = pool.spec.tiers.shared
    if shared is not None and shared.url.startswith("file://"):
        return shared.url[len("file://") :]
    return None


def problems(pool: api.KVCachePool, policy: OperatorPolicy, default_image: str) -> list[str]:
    """Every way the pool goes beyond the policy, one `field: reason` each."""
    out: list[str] = []
    spec = pool.spec
    prefixes = policy.allowed_images or (image_repository(default_image),)
    image = spec.agent.image
    if image and not image_allowed(image, prefixes):
        out.append(
            f"spec.agent.image: {image!r} is not an allowed image "
            f"(allowed: {', '.join(prefixes)})"
        )
    if spec.agent.run_as_user == 0 and not policy.allow_root:
        out.append("spec.agent.runAsUser: running the agent as root (0) is not allowed")
    paths = [("spec.socketDir", spec.socket_dir), ("spec.stateHostPath", spec.state_host_path)]
    if spec.tiers.nvme is not None:
        paths.append(("spec.tiers.nvme.hostPath", spec.tiers.nvme.host_path))
    shared_path = _shared_file_path(pool)
    if shared_path is not None:
        paths.append(("spec.tiers.shared.url", shared_path))
    for field, path in paths:
        problem = host_path_problem(path, policy.host_path_roots)
        if problem is not None:
            out.append(f"{field}: {problem}")
    if not policy.allow_tolerate_all_taints:
        for i, t in enumerate(spec.tolerations or []):
            if not t.key and t.operator == "Exists":
                out.append(
                    f"spec.tolerations[{i}]: a toleration without a key matches every taint, "
                    "which is not allowed"
                )
    if spec.events.enabled and not policy.allow_events:
        out.append(
            "spec.events.enabled: publishing KV events (token ids of cached prefixes, on an "
            "unauthenticated port of every agent) is not allowed"
        )
    if spec.peers.enabled and not policy.allow_peers:
        out.append(
            "spec.peers.enabled: serving chunks between the pool's agents over the pod network "
            "is not allowed"
        )
    return out


def check(pool: api.KVCachePool, policy: OperatorPolicy, default_image: str) -> None:
    """Raise `Forbidden` naming every way the pool goes beyond the policy."""
    found = problems(pool, policy, default_image)
    if found:
        raise Forbidden(
            f"KVCachePool {pool.metadata.name}: not allowed by the operator policy: "
            + "; ".join(found)
        )
