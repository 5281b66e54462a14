"""The `kvpool` command: the agent, its tools, and (loaded lazily) the operator's.

Errors are one line on stderr, `error: ...`, naming the flag or file at fault. Exit status:
0 done, 1 failed, 2 a usage error (a bad flag or value, a file or path that cannot be used).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from . import __version__
from .commandline import USAGE, OneLineErrors
from .commandline import fail as _fail
from .config import AgentConfig, ConfigError, load_agent_config
from .constants import ENV_SOCKET as SOCKET_ENV
from .units import format_size, human_size

app = typer.Typer(
    cls=OneLineErrors,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # plain help: `--socket PATH`, no `<bool>` type column
    pretty_exceptions_enable=False,
)

_DEFAULTS = AgentConfig()


def _with_default(help_text: str, default: str) -> str:
    """Help text with the default a flag stands for when it is left out.

    Written into the text, not as click's show_default: these flags default to None so that
    a config file's value is kept unless the flag is given."""
    return f"{help_text}  [default: {default}]"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvpool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option(
        "--version", help="Print kvpool's version and exit.", is_eager=True,
        callback=_print_version)] = False,
) -> None:
    """kvpool: a tiered KV-cache for LLM inference."""


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format='{"ts":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s",'
        '"msg":"%(message)s"}',
        stream=sys.stderr,
    )


# --------------------------------------------------------------------------- agent

_FLAG_FOR_FIELD: dict[tuple[str | int, ...], str] = {
    ("socket_path",): "--socket",
    ("pool",): "--pool",
    ("metrics_addr",): "--metrics-addr",
    ("max_chunk_bytes",): "--max-chunk",
    ("log_level",): "--log-level",
    ("policy_file",): "--policy",
    ("state_dir",): "--state-dir",
    ("tiers", "dram", "size"): "--dram",
    ("tiers", "dram", "path"): "--arena",
    ("tiers", "nvme", "path"): "--nvme-dir",
    ("tiers", "nvme", "size"): "--nvme",
    ("tiers", "shared", "url"): "--shared",
}


def _flag_errors(err: ValidationError,
                 flag_for_field: dict[tuple[str | int, ...], str] = _FLAG_FOR_FIELD) -> str:
    """A validation error of a model made from flags, each problem naming its flag."""
    problems = []
    for e in err.errors():
        loc = tuple(e["loc"])
        flag = "--tenant" if loc[:1] == ("tenants",) else flag_for_field.get(loc)
        msg = e["msg"].removeprefix("Value error, ")
        given = e.get("input")
        # Name what the user typed, unless the message already quotes it.
        if flag and isinstance(given, str | int | float) and str(given) not in msg:
            problems.append(f"invalid value {given!r} for '{flag}': {msg}")
        else:
            problems.append(f"invalid value for '{flag}': {msg}" if flag else msg)
    return "; ".join(problems)


def _agent_config(config: Path | None, flags: dict[str, Any]) -> AgentConfig:
    """The config file (if any) with the flags given on top; raises ConfigError."""
    cfg = load_agent_config(config) if config else AgentConfig()
    overrides: dict[str, Any] = cfg.model_dump(by_alias=False)
    for field in ("socket_path", "pool", "metrics_addr", "max_chunk_bytes", "log_level",
                  "state_dir"):
        if flags[field] is not None:
            overrides[field] = flags[field]
    if flags["tenant"]:
        overrides["tenants"] = [{"name": name} for name in flags["tenant"]]
    tiers = overrides["tiers"]
    if flags["dram"] is not None:
        tiers["dram"]["size"] = flags["dram"]
    if flags["arena"] is not None:
        tiers["dram"]["path"] = flags["arena"]
    if flags["no_lock"]:
        tiers["dram"]["lock"] = False
    if flags["nvme_dir"] is not None or flags["nvme"] is not None:
        current = tiers.get("nvme") or {}
        path = flags["nvme_dir"] or current.get("path")
        if path is None:
            raise ConfigError("--nvme needs --nvme-dir (or tiers.nvme.path in the config)")
        tiers["nvme"] = {"path": path, "size": flags["nvme"] or current.get("size") or "10Gi"}
    if flags["shared"] is not None:
        tiers["shared"] = {**(tiers.get("shared") or {}), "url": flags["shared"]}
    if flags["policy"] is not None:
        # absolute(), not resolve(): a ConfigMap mount swaps a symlink, and the agent
        # must keep watching the link, not the file it pointed to at start.
        overrides["policy_file"] = flags["policy"].absolute()
    try:
        return AgentConfig.model_validate(overrides)
    except ValidationError as e:
        raise ConfigError(_flag_errors(e)) from e


def _checked_config(config: Path | None, flags: dict[str, Any]) -> AgentConfig:
    """`_agent_config`, its errors and a socket path over the kernel's limit one line each."""
    try:
        cfg = _agent_config(config, flags)
    except ConfigError as e:
        _fail(str(e))
    if problem := cfg.socket_problem():
        _fail(f"{'--socket' if flags['socket_path'] is not None else 'socketPath'} "
              f"{cfg.socket_path}: {problem}")
    return cfg


def _start_error(e: OSError, cfg: AgentConfig, flags: dict[str, Any]) -> tuple[str, int]:
    """One line for an OSError of a failed start, naming the flag (or field) of its path."""
    reason = e.strerror or str(e)
    if e.filename is None:
        if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            return f"--metrics-addr {cfg.metrics_addr}: {reason}", 1
        return f"the agent could not start: {reason}", 1
    failed = Path(e.filename).absolute()
    named = [
        ("--socket", "socketPath", cfg.socket_path, flags["socket_path"]),
        ("--arena", "tiers.dram.path", cfg.arena_path(), flags["arena"]),
        ("--nvme-dir", "tiers.nvme.path", cfg.tiers.nvme.path if cfg.tiers.nvme else None,
         flags["nvme_dir"]),
        ("--policy", "policyFile", cfg.policy_file, flags["policy"]),
        ("--state-dir", "stateDir", cfg.state_dir, flags["state_dir"]),
    ]
    for flag, field, path, given in named:
        if path is None:
            continue
        path = Path(path).absolute()
        if failed == path or failed in path.parents:
            where = f"{flag} {path}" if given is not None else f"{field} {path}"
            if failed != path:
                reason = f"{failed}: {reason}"
            return f"{where}: {reason}", USAGE
    return f"{e.filename}: {reason}", 1


@app.command()
def agent(
    config: Annotated[Path | None, typer.Option(
        metavar="FILE", help="Agent config YAML (AgentConfig); flags override it.")] = None,
    socket: Annotated[Path | None, typer.Option(
        metavar="PATH", help=_with_default("Unix socket to serve on.",
                                          str(_DEFAULTS.socket_path)))] = None,
    pool: Annotated[str | None, typer.Option(
        metavar="NAME", help=_with_default("Pool name.", _DEFAULTS.pool))] = None,
    dram: Annotated[str | None, typer.Option(
        metavar="SIZE", help=_with_default("DRAM arena size (G2).",
                                          format_size(_DEFAULTS.tiers.dram.size)))] = None,
    arena: Annotated[Path | None, typer.Option(
        metavar="PATH", help=_with_default(
            "Arena file.", "/dev/shm/kvpool-<pool>-<hash of the socket path>.arena"))] = None,
    metrics_addr: Annotated[str | None, typer.Option(
        metavar="HOST:PORT", help=_with_default(
            "Where /metrics, /healthz and /readyz are served.", _DEFAULTS.metrics_addr))]
    = None,
    max_chunk: Annotated[str | None, typer.Option(
        metavar="SIZE", help=_with_default(
            "Largest chunk a client may store.", format_size(_DEFAULTS.max_chunk_bytes)))]
    = None,
    nvme_dir: Annotated[Path | None, typer.Option(
        metavar="DIR", help=_with_default("G3 chunk file directory.", "no NVMe tier"))] = None,
    nvme: Annotated[str | None, typer.Option(
        metavar="SIZE", help=_with_default("G3 capacity (with --nvme-dir).", "10Gi"))] = None,
    shared: Annotated[str | None, typer.Option(
        metavar="URL", help=_with_default(
            "G4 shared tier: s3://bucket/prefix or file:///path.", "no shared tier"))] = None,
    policy: Annotated[Path | None, typer.Option(
        metavar="FILE", help="TierPolicy YAML, reloaded when it changes.")] = None,
    state_dir: Annotated[Path | None, typer.Option(
        metavar="DIR", help=_with_default(
            "Directory on disk for the agent's state that must outlive a reboot of the node "
            "(a copy of the record of the file:// shared stores it has used); made if "
            "missing.", "none"))] = None,
    no_lock: Annotated[bool, typer.Option(
        "--no-lock", help="Do not mlock the arena.")] = False,
    log_level: Annotated[str | None, typer.Option(
        metavar="LEVEL",
        help=_with_default("debug, info, warning or error.", _DEFAULTS.log_level))] = None,
    tenant: Annotated[list[str] | None, typer.Option(
        metavar="NAME", help="A tenant with its own socket, arena and NVMe/shared space "
        "(repeat for more; each gets an equal share).")] = None,
) -> None:
    """Run the node agent (from --config, flags, or both: flags win)."""
    flags: dict[str, Any] = {
        "socket_path": socket, "pool": pool, "metrics_addr": metrics_addr,
        "max_chunk_bytes": max_chunk, "log_level": log_level, "tenant": tenant, "dram": dram,
        "arena": arena, "no_lock": no_lock, "nvme_dir": nvme_dir, "nvme": nvme,
        "shared": shared, "policy": policy, "state_dir": state_dir,
    }
    cfg = _checked_config(config, flags)
    root = _absent_shared_root(cfg)
    if root is not None:
        assert cfg.tiers.shared is not None
        where = "--shared" if flags["shared"] is not None else "tiers.shared.url"
        _fail(f"{where} {cfg.tiers.shared.url}: {root} is not a directory: mount the shared "
              "file system there or make the directory first (the agent never makes it: an "
              "absent mount must not become an empty store)")
    _setup_logging(cfg.log_level)
    _serve(cfg, flags)


def _absent_shared_root(cfg: AgentConfig) -> Path | None:
    """The root of a `file://` shared tier that is not a directory, where no space of this
    agent has used a store there (a mistyped path, a mount never made): None otherwise.

    A store the agent has used (by its record) whose directory is gone is an absent mount
    that may come back: that agent starts, with the tier unhealthy until it does."""
    from .seenstores import SeenStores
    from .tiers.sharedfs import root_of

    shared = cfg.tiers.shared
    if shared is None or not shared.url.startswith("file://"):
        return None
    root = root_of(shared.url)
    if root.is_dir():
        return None
    for _, space in cfg.spaces():
        url = space.tiers.shared.url if space.tiers.shared is not None else shared.url
        if SeenStores(*space.stores_paths()).id_of(root_of(url).as_uri()) is not None:
            return None
    return root


def _serve(cfg: AgentConfig, flags: dict[str, Any]) -> None:
    """Run the agent; a start that fails leaves nothing it created behind."""
    from .agentfiles import StartFiles
    from .server import Agent

    created = StartFiles(cfg)
    server: Agent | None = None
    try:
        server = Agent(cfg)
        asyncio.run(server.run())
    except ConfigError as e:
        _fail(str(e))
    except OSError as e:
        _fail(*_start_error(e, cfg, flags))
    finally:
        if server is None or not server.started:
            created.remove_created()


@app.command()
def cleanup(
    config: Annotated[Path | None, typer.Option(
        metavar="FILE", help="The agent's config YAML.")] = None,
    socket: Annotated[Path | None, typer.Option(
        metavar="PATH", help=_with_default("The agent's socket.",
                                          str(_DEFAULTS.socket_path)))]
    = None,
    pool: Annotated[str | None, typer.Option(
        metavar="NAME", help=_with_default("The agent's pool.", _DEFAULTS.pool))] = None,
    arena: Annotated[Path | None, typer.Option(
        metavar="PATH", help="The agent's arena file, if it was given one.")] = None,
    tenant: Annotated[list[str] | None, typer.Option(
        metavar="NAME", help="The agent's tenants (repeat for more).")] = None,
) -> None:
    """Free the DRAM arena and journal a stopped agent left for a warm restart.

    Give the flags the agent ran with (those that name its files). Refused while an agent
    serves the socket or holds the arena's lock, or any process still maps the arena."""
    from .agentfiles import InUse, remove_space_files, space_files

    flags: dict[str, Any] = dict.fromkeys(
        ("metrics_addr", "max_chunk_bytes", "log_level", "dram", "nvme_dir", "nvme",
         "shared", "policy", "state_dir"))
    flags.update(socket_path=socket, pool=pool, arena=arena, tenant=tenant, no_lock=False)
    cfg = _checked_config(config, flags)
    removed = []
    for space in space_files(cfg):
        try:
            removed += remove_space_files(space)
        except InUse as e:
            _fail(str(e), 1)
        except OSError as e:
            _fail(f"{e.filename}: {e.strerror or e}", 1)
    for path, size in removed:
        typer.echo(f"removed {path} ({human_size(size)})")
    if not removed:
        typer.echo("nothing to remove: no arena at "
                   + ", ".join(str(s.arena) for s in space_files(cfg)))


# --------------------------------------------------------------------------- stats

_SOCKET_HELP = _with_default("The agent's socket.",
                             f"${SOCKET_ENV}, else {_DEFAULTS.socket_path}")


def _client_socket(socket: Path | None) -> str:
    """--socket, else $KVPOOL_SOCKET, else the agent's default: the client's own rule.
    A path no socket can have is a usage error naming where it came from."""
    from .client import default_socket
    from .config import socket_path_too_long

    path = default_socket(socket)
    if too_long := socket_path_too_long(Path(path)):
        where = "--socket" if socket is not None else f"${SOCKET_ENV}"
        _fail(f"{where} {path}: {too_long}")  # "N bytes long: ... at most 107 bytes"
    return path


def _unreachable(socket: Path | None, path: str, e: OSError) -> str:
    """Why the agent at `path` did not answer; where no --socket was given, which default
    was tried and how to name another."""
    if socket is not None:
        return f"--socket {path}: cannot reach the agent: {e.strerror or e}"
    reason = f"cannot reach the agent at {path}: {e.strerror or e}"
    source = f"from ${SOCKET_ENV}" if os.environ.get(SOCKET_ENV) else "the agent's default"
    return f"{reason} ({source}; give --socket PATH or set {SOCKET_ENV} for another)"


@app.command()
def stats(
    socket: Annotated[Path | None, typer.Option(
        metavar="PATH", help=_SOCKET_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show an agent's tiers, hits, leases and health."""
    from .client import KVPoolClient

    path = _client_socket(socket)
    try:
        with KVPoolClient(path, mode="inline", reconnect_timeout=0) as c:
            data = c.stats()
    except OSError as e:
        _fail(_unreachable(socket, path, e))
    if as_json:
        typer.echo(json.dumps(data))
        return
    _print_stats(data)


@app.command()
def events(
    socket: Annotated[Path | None, typer.Option(
        metavar="PATH", help="The agent's socket: its STATS says where it publishes. "
        + _SOCKET_HELP)] = None,
    endpoint: Annotated[str | None, typer.Option(
        metavar="tcp://HOST:PORT", help="The agent's PUB socket (instead of --socket).")]
    = None,
    topic: Annotated[str, typer.Option(
        metavar="PREFIX", help="Only topics starting with this (e.g. kv@vllm-0@).")] = "",
    count: Annotated[int | None, typer.Option(
        min=1, metavar="N", help="Stop after N events.")] = None,
    idle: Annotated[float | None, typer.Option(
        min=0.1, metavar="SECONDS", help="Stop after this long without an event.")] = None,
) -> None:
    """Tail an agent's KV events, one line each (docs/events.md)."""
    from .events import tail

    if endpoint is None:
        from .client import KVPoolClient

        path = _client_socket(socket)
        try:
            with KVPoolClient(path, mode="inline", reconnect_timeout=0) as c:
                endpoint = tail.endpoint_of(c.stats())
        except OSError as e:
            _fail(_unreachable(socket, path, e))
        except ValueError as e:
            _fail(str(e), 1)
    elif not endpoint.startswith("tcp://"):
        _fail(f"--endpoint {endpoint}: expected tcp://HOST:PORT")
    seen = 0
    try:
        for line in tail.lines(endpoint, topic, idle):
            typer.echo(line)
            if not line.startswith("#"):
                seen += 1
                if count is not None and seen >= count:
                    return
    except ValueError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        return


def _print_stats(data: dict[str, Any]) -> None:
    from rich.table import Table

    from .commandline import console as new_console
    from .statsview import COLUMNS, PEER_COLUMNS, peer_rows, summary, tier_rows, title

    console = new_console()
    tables: list[tuple[str, tuple[str, ...], list[tuple[str, ...]]]] = [
        (title(data), COLUMNS, tier_rows(data))]
    peers = peer_rows(data)
    if peers:
        tables.append(("peers", PEER_COLUMNS, peers))
    for name, columns, rows in tables:
        table = Table(title=name)
        for col in columns:
            table.add_column(col)
        for row in rows:
            table.add_row(*row)
        console.print(table)
    console.print(summary(data))


# --------------------------------------------------------------------------- tools


@app.command()
def demo(
    trace: Annotated[Path | None, typer.Option(
        metavar="FILE", help=_with_default("Mooncake-format JSONL trace.", "the bundled one"))]
    = None,
    as_json: Annotated[bool, typer.Option("--json", help="Last line: one JSON object.")] = False,
    block_bytes: Annotated[str, typer.Option(
        metavar="SIZE", help="Bytes stored per trace block.")] = "16Ki",
    dram: Annotated[str, typer.Option(
        metavar="SIZE|N%", help="DRAM capacity: a size or a share of the trace's blocks.")]
    = "5%",
    nvme: Annotated[str, typer.Option(
        metavar="SIZE|N%", help="NVMe capacity: a size or a share of the trace's blocks.")]
    = "30%",
    shared: Annotated[str, typer.Option(
        metavar="URL|none", help=_with_default(
            "Shared tier (s3://... or file:///...); 'none': no shared tier.",
            "a temporary directory"))] = "",
    requests: Annotated[int | None, typer.Option(
        metavar="N", help=_with_default("Replay only the first N requests.", "all"))] = None,
    events: Annotated[bool, typer.Option(
        "--events/--no-events", help="Publish KV events (on a free port it prints, for "
        "`kvpool events --endpoint`) and count them live.")] = True,
    nodes: Annotated[int, typer.Option(
        metavar="N", help="1, or 2: two agents as two nodes of one pool (peers on 127.0.0.1); "
        "node 1 replays the trace's first half, then node 2 the same requests, and the "
        "report says how many of node 2's hits came from node 1.")] = 1,
) -> None:
    """Start a local agent and replay a real request trace through it."""
    from kvpool.bench.demo import DemoError, run_demo

    try:
        run_demo(trace=trace, as_json=as_json, block_bytes=block_bytes, dram=dram, nvme=nvme,
                 shared=shared, requests=requests, events=events, nodes=nodes)
    except DemoError as e:
        _fail(str(e))


@app.command()
def bench(
    quick: Annotated[bool, typer.Option(
        "--quick", help="Fewer sizes, rounds and trace requests (what CI runs; a few minutes).")]
    = False,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Tables on stderr; the result as one JSON object on stdout's last line.")]
    = False,
    out: Annotated[Path | None, typer.Option(
        metavar="DIR", help="Write bench.json and the PNG plots into this directory.")] = None,
    trace: Annotated[Path | None, typer.Option(
        metavar="FILE",
        help="Replay this Mooncake-format JSONL trace instead of the bundled one.")] = None,
    gpu: Annotated[bool, typer.Option(
        "--gpu", help="Only the GPU data path and time to first token (needs CUDA; where "
        "there is none it says so and exits 0).")] = False,
    part: Annotated[list[str] | None, typer.Option(
        "--part", metavar="NAME",
        help="Run only this part (repeatable): data (needs redis-server and the redis "
        "package), events, control, tiers (its G4 figures need moto[server]), hit-ratio "
        "(its libCacheSim peers need libcachesim), scale, peer (the peer tier between two "
        "network namespaces against raw TCP; needs root and iproute2), vllm (vLLM's time to "
        "first token "
        "with a kvpool hit; needs a vLLM environment: tests/install-vllm or "
        "$KVPOOL_VLLM_PYTHON). Default: every part but vllm.")] = None,
) -> None:
    """Measure every figure against its baseline (memcpy, Redis, raw files, boto3, LRU,
    Belady and libCacheSim), in one run on this machine.

    What this machine lacks for a part (a baseline's program or package) is named with how
    to get it, before anything runs, and that part (or its section) is left out; with
    nothing left to run, that is an error. `pip install '.[bench]'` from a checkout and
    `apt-get install redis-server` give every part."""
    if gpu:
        from kvpool.bench.gpu import run_gpu_bench

        run_gpu_bench(quick=quick, as_json=as_json, out=out)
        return
    from kvpool.bench.suite import DEFAULT_PARTS, PARTS, run_bench
    from kvpool.bench.trace import load_trace

    parts = part or list(DEFAULT_PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        _fail(f"--part {unknown[0]}: not a bench part (one of {', '.join(PARTS)})")

    from kvpool.bench.needs import left_out

    unrunnable = {p: why for p, why in left_out(parts, plots=False).items() if p in parts}
    if len(unrunnable) == len(set(parts)):  # every part asked for: nothing would run
        _fail("; ".join(f"--part {p} {why}" for p, why in unrunnable.items()))
    if trace is not None:
        try:  # a bad trace is a clear error before any part runs, not a traceback after
            load_trace(trace, limit=1)
        except (OSError, ValueError) as e:
            _fail(str(e))
    run_bench(quick=quick, as_json=as_json, out=out, trace_path=trace, parts=parts)


@app.command()
def gc(
    shared: Annotated[str, typer.Option(
        metavar="URL", help="The pool's shared tier: s3://... or file:///...")],
    ttl: Annotated[str | None, typer.Option(
        metavar="DURATION", help="Delete objects older than this, e.g. 7d.")] = None,
    all_objects: Annotated[bool, typer.Option("--all", help="Delete every chunk object.")]
    = False,
    endpoint_url: Annotated[str | None, typer.Option(
        metavar="URL", help=_with_default("S3 endpoint URL.", "from the AWS environment"))]
    = None,
    addressing_style: Annotated[str, typer.Option(
        metavar="STYLE", help="S3 bucket addressing: auto, path (most self-hosted stores) or "
        "virtual.")] = "auto",
    tenant: Annotated[list[str] | None, typer.Option(
        metavar="NAME", help="Also collect this tenant's prefix, <shared>/tenants/<name> "
        "(repeat for more).")] = None,
    init_store: Annotated[bool, typer.Option(
        "--init-store", help="file:// only: mark the store's root (and each --tenant's) as "
        "a kvpool store where it has no marker, e.g. a new file system in the old one's "
        "place; run it where the file system is mounted.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Delete a pool's expired (or all) chunk objects from its shared tier; mark a file://
    store afresh (--init-store)."""
    if ttl is not None and all_objects:
        _fail("give exactly one of --ttl DURATION or --all")
    if ttl is None and not all_objects and not init_store:
        _fail("give one of --ttl DURATION or --all (or --init-store)")
    if init_store and not shared.startswith("file://"):
        _fail(f"--init-store: {shared} has no store marker: only a file:// store has one")
    from .config import SharedTier
    from .gc import init_stores, run_gc
    from .units import parse_duration

    try:
        ttl_seconds = parse_duration(ttl) if ttl is not None else None
    except ValueError as e:
        _fail(f"invalid value for '--ttl': {e}")
    try:
        SharedTier.model_validate({"url": shared, "endpoint_url": endpoint_url,
                                   "addressing_style": addressing_style})
    except ValidationError as e:
        _fail(_flag_errors(e, {("url",): "--shared", ("endpoint_url",): "--endpoint-url",
                               ("addressing_style",): "--addressing-style"}))
    root = Path(shared.removeprefix("file://"))
    if shared.startswith("file://") and not root.is_dir():
        _fail(f"--shared {shared}: {root} is not a directory")  # never make one to empty it
    # The tier's own log (e.g. "shared tier ... unhealthy") would repeat the error line.
    logging.getLogger("kvpool").setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    if init_store:  # first: a --all after it empties the store it marked, not a mount point
        try:
            marks = init_stores(shared, tenant or ())
        except OSError as e:
            _fail(f"--init-store: {e}", 1)
        out["stores"] = [{"url": m.url, "id": m.id, "created": m.created} for m in marks]
        if not as_json:
            for m in marks:
                typer.echo(f"{'marked' if m.created else 'already marked'} {m.url} as a "
                           f"kvpool store (id {m.id or 'from before ids'})")
    errors = 0
    if ttl_seconds is not None or all_objects:
        try:
            result = run_gc(shared, ttl_seconds, all_objects, endpoint_url,
                            addressing_style=addressing_style, tenants=tenant or ())
        except ValueError as e:
            _fail(str(e))
        except OSError as e:
            _fail(str(e), 1)
        out.update(result.to_json())
        errors = result.errors
        if not as_json:
            typer.echo(f"deleted {result.deleted} chunk objects "
                       f"({human_size(result.bytes_freed)}), kept {result.kept}, "
                       f"could not delete {result.errors}")
    if as_json:
        typer.echo(json.dumps(out))
    if errors:
        raise typer.Exit(1)


# --------------------------------------------------------------------------- operator


def _forward_to_operator(name: str, help_text: str) -> None:
    """Register `kvpool <name>` as a lazy pass-through to kvpool.operator.cli."""

    @app.command(
        name=name, help=help_text, add_help_option=False,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    def forward(ctx: typer.Context) -> None:
        from kvpool.operator.cli import app as operator_app

        operator_app([name, *ctx.args], prog_name="kvpool")


_forward_to_operator("operator", "Run the kvpool operator (kopf).")
_forward_to_operator("crds", "Print the CustomResourceDefinitions.")
_forward_to_operator("render", "Print the manifests the operator applies for a pool.")


def main() -> None:
    """The `kvpool` command: every error one line, `error: ...` (usage errors exit 2)."""
    app()
