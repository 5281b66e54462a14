"""What the agent says when it starts serving and when it stops: every tier with its size and
place, the addresses it really bound, and what it leaves behind on purpose.

Pure functions of the config and what was opened, so the words are tested apart from the
agent that logs them.
"""

from __future__ import annotations

from pathlib import Path

from ..config import AgentConfig
from ..units import human_size


def tiers_line(cfg: AgentConfig, arena_bytes: int, arena_path: Path) -> str:
    """Each tier of one space: `DRAM 1.0 GiB at /dev/shm/...; NVMe 10.0 GiB at /mnt/...;
    shared s3://bucket/prefix` (no NVMe or shared part when the space has none)."""
    parts = [f"DRAM {human_size(arena_bytes)} at {arena_path}"]
    if cfg.tiers.nvme is not None:
        parts.append(f"NVMe {human_size(cfg.tiers.nvme.size)} at {cfg.tiers.nvme.path}")
    if cfg.tiers.shared is not None:
        parts.append(f"shared {cfg.tiers.shared.url}")
    return "; ".join(parts)


def bound_address(sockname: tuple[object, ...] | str) -> str:
    """`host:port` of a bound TCP socket (IPv6 hosts in brackets), e.g. the port the
    kernel chose for `--metrics-addr 127.0.0.1:0`."""
    if isinstance(sockname, str):
        return sockname
    host, port = str(sockname[0]), sockname[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def cleanup_command(cfg: AgentConfig) -> str:
    """The `kvpool cleanup` that frees what this agent keeps in memory after it stops:
    the flags of the agent's that name its files."""
    words = ["kvpool", "cleanup", "--socket", str(cfg.socket_path)]
    if cfg.pool != AgentConfig().pool:
        words += ["--pool", cfg.pool]
    if cfg.tiers.dram.path is not None:
        words += ["--arena", str(cfg.tiers.dram.path)]
    for tenant in cfg.tenants:
        words += ["--tenant", tenant.name]
    return " ".join(words)


def kept_line(cfg: AgentConfig, arenas: list[tuple[Path, int]]) -> str:
    """At stop: the arenas (and journals) kept for a warm restart, and how to free them."""
    kept = ", ".join(f"{path} ({human_size(size)})" for path, size in arenas)
    return (f"kept for a warm restart: the DRAM arena {kept} and its journal, holding that "
            f"memory until a restarted agent takes them up; once the agent is gone for good, "
            f"free them with: {cleanup_command(cfg)}")
