"""The operator's commands: `kvpool operator`, `kvpool crds`, `kvpool render`.

The `kvpool` command forwards to `app` lazily, so importing this module is the
only cost the agent pays for the operator's commands.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from kvpool.agent.commandline import OneLineErrors, fail
from kvpool.agent.constants import (
    ENV_AGENT_IMAGE,
    ENV_ALL_NAMESPACES,
    ENV_ALLOW_EVENTS,
    ENV_ALLOW_PEERS,
    ENV_ALLOW_ROOT,
    ENV_ALLOW_TOLERATE_ALL_TAINTS,
    ENV_ALLOWED_IMAGES,
    ENV_HOST_PATH_ROOTS,
    ENV_LIVENESS_PORT,
    ENV_METRICS_PORT,
    ENV_NAMESPACES,
    ENV_POD_MONITOR,
    ENV_RESYNC_SECONDS,
    ENV_WEBHOOK_CERT_DIR,
    ENV_WEBHOOK_PORT,
)

from . import api
from .crds import crds_yaml, to_yaml, write_crds
from .operator_policy import DEFAULT_HOST_PATH_ROOTS, OperatorPolicy, normalize_host_path
from .render import Settings, render

app = typer.Typer(
    cls=OneLineErrors,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # plain help, as the rest of `kvpool`: no `<bool>` type column
    help="The kvpool operator and its tools.",
)



# The operator policy: the same flags, environment and defaults for `kvpool operator` and
# `kvpool render`, so a render shows what the operator would accept.
AllowedImages = Annotated[
    list[str] | None,
    typer.Option(
        "--allowed-image",
        metavar="IMAGE",
        envvar=ENV_ALLOWED_IMAGES,
        help="Image a pool's spec.agent.image may name: a repository (any tag or digest "
        "of it) or a prefix ending in '/' (repeatable; from env: space-separated). "
        "Default: the repository of the agent image only.",
    ),
]
AllowRoot = Annotated[
    bool,
    typer.Option(
        envvar=ENV_ALLOW_ROOT, help="Allow pools to run their agent as root (runAsUser: 0)."
    ),
]
HostPathRoots = Annotated[
    list[str] | None,
    typer.Option(
        "--host-path-root",
        metavar="DIR",
        envvar=ENV_HOST_PATH_ROOTS,
        help="Directory below which a pool's nvme.hostPath, file:// shared URL, socketDir and "
        "stateHostPath may lie (repeatable; from env: space-separated). Default: "
        + " ".join(DEFAULT_HOST_PATH_ROOTS)
        + ". System directories (/, /etc, /proc, ...) are refused whatever this says.",
    ),
]
AllowTolerateAll = Annotated[
    bool,
    typer.Option(
        envvar=ENV_ALLOW_TOLERATE_ALL_TAINTS,
        help="Allow tolerations that match every taint (no key, operator Exists).",
    ),
]
AllowEvents = Annotated[
    bool,
    typer.Option(
        envvar=ENV_ALLOW_EVENTS,
        help="Allow pools to publish KV events to routers (spec.events.enabled): an "
        "unauthenticated port on every agent carrying the token ids of cached prefixes.",
    ),
]
AllowPeers = Annotated[
    bool,
    typer.Option(
        envvar=ENV_ALLOW_PEERS,
        help="Allow pools to serve chunks between their agents over the pod network "
        "(spec.peers.enabled): authenticated by the pool's secret, unencrypted without TLS.",
    ),
]


def operator_policy(
    allowed_images: list[str] | None,
    allow_root: bool,
    host_path_roots: list[str] | None,
    allow_tolerate_all_taints: bool,
    allow_events: bool,
    allow_peers: bool,
) -> OperatorPolicy:
    """The policy from the flags; `typer.Exit` with an `error:` line for a bad root."""
    images = tuple(i for item in allowed_images or [] for i in item.split())
    roots = tuple(r for item in host_path_roots or [] for r in item.split())
    for root in roots:
        try:
            normalize_host_path(root)
        except ValueError as e:
            fail(f"--host-path-root {root!r} {e}")
    return OperatorPolicy(
        allowed_images=images,
        allow_root=allow_root,
        host_path_roots=roots or DEFAULT_HOST_PATH_ROOTS,
        allow_tolerate_all_taints=allow_tolerate_all_taints,
        allow_events=allow_events,
        allow_peers=allow_peers,
    )


@app.command("crds")
def crds_command(
    output_dir: Annotated[
        Path | None,
        typer.Option("--output-dir", "-o", metavar="DIR",
                     help="Write one file per CRD here instead of printing."),
    ] = None,
) -> None:
    """Print the kvpool CRDs (multi-document YAML), built from the API models."""
    if output_dir is None:
        typer.echo(crds_yaml(), nl=False)
        return
    try:
        written = write_crds(output_dir)
    except OSError as e:  # a file in the directory's place, a read-only place, ...
        at = f" ({e.filename})" if e.filename and Path(e.filename) != output_dir else ""
        reason = "exists and is not a directory" if e.errno == errno.EEXIST else e.strerror
        fail(f"--output-dir {output_dir}: {reason or e}{at}")
    for path in written:
        typer.echo(str(path))


def _load_documents(files: list[Path]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in files:
        try:
            text = path.read_text() if str(path) != "-" else typer.get_text_stream("stdin").read()
            loaded = [d for d in yaml.safe_load_all(text) if d]
        except OSError as e:
            fail(f"{path}: cannot read: {e.strerror}")
        except yaml.YAMLError as e:
            fail(f"{path}: not valid YAML: {e}")
        for doc in loaded:
            if not isinstance(doc, dict):
                fail(f"{path}: every document must be a mapping")
            docs.append(doc)
    return docs


@app.command("render")
def render_command(
    files: Annotated[
        list[Path],
        typer.Option(
            "--filename", "-f", metavar="FILE",
            help="YAML with a KVCachePool (and its KVTierPolicy); repeatable.",
        ),
    ],
    agent_image: Annotated[
        str,
        typer.Option(metavar="IMAGE", envvar=ENV_AGENT_IMAGE,
                     help="Agent image for pools that name none."),
    ] = "",
    pod_monitor: Annotated[
        bool, typer.Option(help="Also render a PodMonitor (Prometheus Operator).")
    ] = False,
    allowed_image: AllowedImages = None,
    allow_root: AllowRoot = False,
    host_path_root: HostPathRoots = None,
    allow_tolerate_all_taints: AllowTolerateAll = False,
    allow_events: AllowEvents = True,
    allow_peers: AllowPeers = True,
) -> None:
    """Print the manifests the operator applies for a pool, as multi-document YAML."""
    docs = _load_documents(files)
    pools = [d for d in docs if d.get("kind") == api.POOL_KIND]
    policies = [d for d in docs if d.get("kind") == api.POLICY_KIND]
    for d in docs:
        if d.get("kind") not in (api.POOL_KIND, api.POLICY_KIND):
            name = (d.get("metadata") or {}).get("name", "?")
            typer.echo(f"note: ignoring {d.get('kind')} {name}", err=True)
    if not pools:
        fail("no KVCachePool in the given files")
    settings = Settings(
        agent_image=agent_image,
        pod_monitor=pod_monitor,
        policy=operator_policy(
            allowed_image,
            allow_root,
            host_path_root,
            allow_tolerate_all_taints,
            allow_events,
            allow_peers,
        ),
    )
    out: list[dict[str, Any]] = []
    try:
        by_name = {}
        for body in policies:
            p = api.parse_policy(body)
            by_name[(p.metadata.namespace, p.metadata.name)] = p
        for body in pools:
            pool = api.parse_pool(body)
            policy = None
            ref = pool.spec.policy_ref
            if ref is not None:
                policy = by_name.get((pool.metadata.namespace, ref.name))
                if policy is None:
                    fail(
                        f"KVCachePool {pool.metadata.name} references KVTierPolicy "
                        f"{ref.name!r} in namespace {pool.metadata.namespace!r}: "
                        "pass it with another -f"
                    )
            out.extend(render(pool, policy, settings))
    except api.InvalidSpec as e:
        fail(str(e))
    typer.echo("---\n".join(to_yaml(o) for o in out), nl=False)


@app.command("operator")
def operator_command(
    namespace: Annotated[
        list[str] | None,
        typer.Option(
            "--namespace",
            "-n",
            metavar="NS",
            envvar=ENV_NAMESPACES,
            help="Namespace to watch (repeatable; glob patterns allowed). "
            "From env: space-separated.",
        ),
    ] = None,
    all_namespaces: Annotated[
        bool,
        typer.Option(
            "--all-namespaces",
            "-A",
            envvar=ENV_ALL_NAMESPACES,
            help="Watch the whole cluster.",
        ),
    ] = False,
    metrics_port: Annotated[
        int,
        typer.Option(metavar="PORT", envvar=ENV_METRICS_PORT, help="Port of /metrics (0: off)."),
    ] = 8080,
    liveness_port: Annotated[
        int,
        typer.Option(metavar="PORT", envvar=ENV_LIVENESS_PORT, help="Port of /healthz (0: off)."),
    ] = 8081,
    webhook_port: Annotated[
        int,
        typer.Option(metavar="PORT", envvar=ENV_WEBHOOK_PORT,
                     help="HTTPS port of the webhook (0: off)."),
    ] = 9443,
    webhook_cert_dir: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            envvar=ENV_WEBHOOK_CERT_DIR,
            help="Directory with tls.crt and tls.key for the webhook.",
        ),
    ] = None,
    agent_image: Annotated[
        str,
        typer.Option(metavar="IMAGE", envvar=ENV_AGENT_IMAGE,
                     help="Agent image for pools that name none."),
    ] = "",
    pod_monitor: Annotated[
        bool,
        typer.Option(
            envvar=ENV_POD_MONITOR,
            help="Render a PodMonitor per pool (Prometheus Operator CRDs needed).",
        ),
    ] = False,
    resync_seconds: Annotated[
        float,
        typer.Option(
            metavar="SECONDS",
            envvar=ENV_RESYNC_SECONDS,
            help="Re-reconcile every pool this often (drift repair, retries).",
        ),
    ] = 300.0,
    allowed_image: AllowedImages = None,
    allow_root: AllowRoot = False,
    host_path_root: HostPathRoots = None,
    allow_tolerate_all_taints: AllowTolerateAll = False,
    allow_events: AllowEvents = True,
    allow_peers: AllowPeers = True,
) -> None:
    """Run the operator (kopf, embedded): reconcile pools, serve the pod webhook."""
    namespaces = [n for item in namespace or [] for n in item.split()]
    if not namespaces and not all_namespaces:
        fail("give --namespace NS (repeatable) or --all-namespaces")
    if namespaces and all_namespaces:
        fail("--namespace and --all-namespaces exclude each other")
    if webhook_port and webhook_cert_dir is None:
        fail("the webhook needs --webhook-cert-dir (or --webhook-port 0 to disable it)")
    from .run import OperatorOptions, run_operator

    options = OperatorOptions(
        namespaces=namespaces,
        clusterwide=all_namespaces,
        metrics_port=metrics_port,
        liveness_port=liveness_port,
        webhook_port=webhook_port,
        webhook_cert_dir=webhook_cert_dir,
        settings=Settings(
            agent_image=agent_image,
            pod_monitor=pod_monitor,
            policy=operator_policy(
                allowed_image,
                allow_root,
                host_path_root,
                allow_tolerate_all_taints,
                allow_events,
                allow_peers,
            ),
        ),
        resync_seconds=resync_seconds,
    )
    run_operator(options)


def main() -> None:  # pragma: no cover - `python -m kvpool.operator.cli`
    app(prog_name="kvpool")


if __name__ == "__main__":  # pragma: no cover
    main()
