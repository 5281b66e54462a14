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
    return written
