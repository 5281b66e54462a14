"""The `kvpool` command: the agent, its tools, and (loaded lazily) the operator's."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from .config import AgentConfig, ConfigError, load_agent_config

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="kvpool: a tiered KV-cache for LLM inference.",
    pretty_exceptions_enable=False,
)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format='{"ts":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s",'
        '"msg":"%(message)s"}',
        stream=sys.stderr,
    )


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@app.command()
def agent(
    config: Annotated[Path | None, typer.Option(help="Agent config YAML (AgentConfig).")] = None,
    socket: Annotated[Path | None, typer.Option(help="Unix socket to serve on.")] = None,
    pool: Annotated[str | None, typer.Option(help="Pool name.")] = None,
    dram: Annotated[str | None, typer.Option(help="DRAM arena size, e.g. 1Gi.")] = None,
    arena: Annotated[Path | None, typer.Option(help="Arena file (default under /dev/shm).")] = None,
    metrics_addr: Annotated[str | None, typer.Option(help="host:port for /metrics.")] = None,
    max_chunk: Annotated[str | None, typer.Option(help="Largest chunk, e.g. 64Mi.")] = None,
    nvme_dir: Annotated[Path | None, typer.Option(help="G3 chunk file directory.")] = None,
    nvme: Annotated[str | None, typer.Option(help="G3 capacity, e.g. 100Gi.")] = None,
    shared: Annotated[str | None, typer.Option(
        help="G4 shared tier: s3://bucket/prefix or file:///path.")] = None,
    policy: Annotated[Path | None, typer.Option(help="TierPolicy YAML (hot-reloaded).")] = None,
    no_lock: Annotated[bool, typer.Option("--no-lock", help="Do not mlock the arena.")] = False,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning, error.")] = None,
    tenant: Annotated[list[str] | None, typer.Option(
        help="A tenant with its own socket, arena and NVMe/shared space (repeat for more; "
        "each gets an equal share).")] = None,
) -> None:
    """Run the node agent (from --config, flags, or both: flags win)."""
    try:
        cfg = load_agent_config(config) if config else AgentConfig()
        overrides: dict[str, Any] = cfg.model_dump(by_alias=False)
        if socket:
            overrides["socket_path"] = socket
        if pool:
            overrides["pool"] = pool
        if metrics_addr:
            overrides["metrics_addr"] = metrics_addr
        if max_chunk:
            overrides["max_chunk_bytes"] = max_chunk
        if log_level:
            overrides["log_level"] = log_level
        if tenant:
            overrides["tenants"] = [{"name": name} for name in tenant]
        dram_cfg = overrides["tiers"]["dram"]
        if dram:
            dram_cfg["size"] = dram
        if arena:
            dram_cfg["path"] = arena
        if no_lock:
            dram_cfg["lock"] = False
        if nvme_dir or nvme:
            current = overrides["tiers"].get("nvme") or {}
            overrides["tiers"]["nvme"] = {
                "path": nvme_dir or current.get("path"),
                "size": nvme or current.get("size") or "10Gi",
            }
        if shared:
            current = overrides["tiers"].get("shared") or {}
            overrides["tiers"]["shared"] = {**current, "url": shared}
        if policy:
            # absolute(), not resolve(): a ConfigMap mount swaps a symlink, and the agent
            # must keep watching the link, not the file it pointed to at start.
            overrides["policy_file"] = policy.absolute()
        cfg = AgentConfig.model_validate(overrides)
    except ConfigError as e:
        _fail(str(e))
        return
    except ValueError as e:
        _fail(str(e))
        return
    _setup_logging(cfg.log_level)
    from .server import run_agent

    try:
        run_agent(cfg)
    except ConfigError as e:
        _fail(str(e))


@app.command()
def stats(
    socket: Annotated[Path, typer.Option(help="The agent's socket.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show an agent's tiers, hits, leases and health."""
    from .client import KVPoolClient

    try:
        with KVPoolClient(socket, mode="inline", reconnect_timeout=0) as c:
            data = c.stats()
    except OSError as e:
        _fail(f"cannot reach the agent at {socket}: {e}")
        return
    if as_json:
        typer.echo(json.dumps(data))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"pool {data.get('pool')}")
    for col in ("tier", "capacity", "used", "chunks", "hits", "misses", "healthy"):
        table.add_column(col)
    for name, t in data.get("tiers", {}).items():
        table.add_row(name, _size(t["capacity_bytes"]), _size(t["used_bytes"]), str(t["chunks"]),
                      str(t["hits"]), str(t["misses"]),
                      "yes" if t["healthy"] else f"no: {t.get('reason', '')}")
    console = Console()
    console.print(table)
    console.print(f"clients {data.get('clients')}  leases {data.get('leases')}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@app.command()
def demo(
    trace: Annotated[Path | None, typer.Option(help="Mooncake-format JSONL trace.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Last line: one JSON object.")] = False,
    block_bytes: Annotated[str, typer.Option(help="Bytes stored per trace block.")] = "16Ki",
    dram: Annotated[str, typer.Option(help="DRAM capacity: a size or % of blocks.")] = "5%",
    nvme: Annotated[str, typer.Option(help="NVMe capacity: a size or % of blocks.")] = "30%",
    shared: Annotated[str, typer.Option(
        help="Shared tier URL (s3://... or file:///...); default: a temporary directory; "
        "'none': no shared tier.")] = "",
    requests: Annotated[int | None, typer.Option(help="Replay only the first N.")] = None,
) -> None:
    """Start a local agent and replay a real request trace through it."""
    from kvpool.bench.demo import run_demo

    try:
        run_demo(trace=trace, as_json=as_json, block_bytes=block_bytes, dram=dram, nvme=nvme,
                 shared=shared, requests=requests)
    except (ConfigError, ValueError) as e:
        _fail(str(e))


@app.command()
def bench(
    quick: Annotated[bool, typer.Option(
        help="Fewer sizes, rounds and trace requests (what CI runs; a few minutes).")] = False,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Tables on stderr; the result as one JSON object on stdout's last line.")]
    = False,
    out: Annotated[Path | None, typer.Option(
        help="Write bench.json and the PNG plots into this directory.")] = None,
) -> None:
    """Measure every figure against its baseline (memcpy, Redis, raw files, boto3, LRU and
    Belady), in one run on this machine."""
    from kvpool.bench.suite import run_bench

    run_bench(quick=quick, as_json=as_json, out=out)


@app.command()
def gc(
    shared: Annotated[str, typer.Option(help="The pool's shared tier: s3://... or file:///...")],
    ttl: Annotated[str | None, typer.Option(help="Delete objects older than this, e.g. 7d.")]
    = None,
    all_objects: Annotated[bool, typer.Option("--all", help="Delete every chunk object.")]
    = False,
    endpoint_url: Annotated[str | None, typer.Option(help="S3 endpoint URL.")] = None,
    addressing_style: Annotated[str, typer.Option(
        help="S3 bucket addressing: auto, path (most self-hosted stores) or virtual.")] = "auto",
    tenant: Annotated[list[str] | None, typer.Option(
        help="Also collect this tenant's prefix, <shared>/tenants/<name> (repeat for more).")]
    = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Delete a pool's expired (or all) chunk objects from its shared tier."""
    if (ttl is None) == (not all_objects):
        _fail("give exactly one of --ttl DURATION or --all")
    from dataclasses import asdict

    from .gc import run_gc

    try:
        result = run_gc(shared, ttl, all_objects, endpoint_url,
                        addressing_style=addressing_style, tenants=tenant or ())
    except (ValueError, OSError) as e:
        _fail(str(e))
        return
    data = asdict(result)
    typer.echo(json.dumps(data) if as_json else
               " ".join(f"{k}={v}" for k, v in data.items()))
    if result.errors:
        raise typer.Exit(1)


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
    app()
