"""PNG plots of a `kvpool bench` result (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    if "g2" in result:
        sizes = list(result["g2"])
        mib = [int(s.removesuffix("MiB")) for s in sizes]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        for ax, op in zip(axes, ("put", "get"), strict=True):
            ax.plot(mib, [result["g2"][s]["memcpy_gbps"] for s in sizes], "k--", label="memcpy")
            for section, label in (("g2", "kvpool zero-copy"), ("inline", "kvpool inline"),
                                   ("redis", "Redis (Unix socket)")):
                ax.plot(mib, [result[section][s][f"{op}_gbps"] for s in sizes], "o-", label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(mib, sizes)
            ax.set_xlabel("chunk size")
            ax.set_title(op)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("GB/s (median)")
        axes[1].legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        path = out / "throughput.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if "trace" in result:
        caps = result["trace"]["capacities"]
        x = [c["fraction"] * 100 for c in caps]
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        ax.plot(x, [c["optimal"] for c in caps], "k-", lw=2, label="Belady MIN (offline)")
        ax.plot(x, [c["lru"] for c in caps], "k--", label="LRU (simulated)")
        ax.plot(x, [c["unbounded"] for c in caps], ":", color="grey", label="unbounded cache")
        for name in caps[0]["policies"]:
            (line,) = ax.plot(x, [c["policies"][name] for c in caps], "o-", label=f"agent: {name}")
            # The same order's queue simulated offline, thin and in the same colour: a gap
            # between the two is the store not evicting the way its queue says.
            ax.plot(x, [c["simulated"][name] for c in caps], ":", color=line.get_color(), lw=1)
        ax.set_xlabel("capacity, % of distinct blocks")
        ax.set_ylabel("block hit ratio")
        ax.set_title(f"Mooncake trace, {result['trace']['requests']} requests "
                     "(dotted: each order's queue simulated)", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / "hit_ratio.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    for section, name in (("trace", "hit_ratio_peers.png"),
                          ("conversation", "hit_ratio_peers_conversation.png")):
        caps = [c for c in result.get(section, {}).get("capacities", []) if "libcachesim" in c]
        if caps:
            written.append(_peers_plot(plt, result[section], caps, out / name, section))
    return written


def _peers_plot(plt: Any, section: dict[str, Any], caps: list[dict[str, Any]], path: Path,
                label: str) -> Path:
    """The agent's orders (thick) among every libCacheSim online policy (thin, grey)."""
    x = [c["fraction"] * 100 for c in caps]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(caps[0]["libcachesim"]):
        ax.plot(x, [c["libcachesim"][name] for c in caps], "-", color="grey", lw=0.7,
                alpha=0.6, label="libCacheSim online policies" if i == 0 else None)
    ax.plot(x, [next(iter(c["libcachesim_best"].values())) for c in caps], "k--",
            label="best libCacheSim policy at each capacity")
    ax.plot(x, [c["peer_optimal"] for c in caps], "k-", lw=2, label="Belady MIN (offline)")
    for name in caps[0]["peer_agent"]:
        ax.plot(x, [c["peer_agent"][name] for c in caps], "o-", label=f"kvpool {name}")
    ax.set_xlabel("capacity, % of distinct blocks")
    ax.set_ylabel("prefix hit ratio (simulated)")
    ax.set_title(f"{label}, {section['peer_requests']} requests: kvpool vs libCacheSim",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
