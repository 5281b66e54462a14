"""What `kvpool stats` shows of an agent's STATS reply, in words, with the standard library
only: the full command prints it as a rich table, the light install's as plain columns."""

from __future__ import annotations

from typing import Any

from .sizes import human_size

COLUMNS = ("tier", "capacity", "used", "chunks", "hits", "misses", "healthy", "notes")


def title(data: dict[str, Any]) -> str:
    text = f"pool {data.get('pool')}"
    if data.get("tenant"):
        text += f", tenant {data['tenant']}"
    return text


def tier_notes(t: dict[str, Any]) -> str:
    """What a tier reports beyond the table's columns, in words (never a Python repr)."""
    notes = []
    if t.get("url"):
        notes.append(str(t["url"]))
    if t.get("lock_error"):
        notes.append(f"not locked: {t['lock_error']}")
    if t.get("inflight"):
        notes.append(f"{t['inflight']} being demoted")
    if t.get("removing"):
        notes.append(f"{t['removing']} being removed")
    queue = t.get("queue")
    if isinstance(queue, dict) and queue:
        notes.append(f"uploads: {queue.get('pending', 0)} pending, "
                     f"{queue.get('in_flight', 0)} in flight, {queue.get('written', 0)} "
                     f"written, {queue.get('dropped', 0)} dropped")
    if "handoff_pins" in t:
        notes.append(f"hand-offs pinned: {t['handoff_pins']} "
                     f"({human_size(t.get('handoff_bytes', 0))})")
    return "; ".join(notes)


def tier_rows(data: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row of `COLUMNS` per tier. The peer tier has no capacity nor bytes of its own
    (its chunks are those the directory says other agents hold): "-" there."""
    rows: list[tuple[str, ...]] = []
    for name, t in data.get("tiers", {}).items():
        if "capacity_bytes" not in t:
            capacity = used = "-"
        else:
            capacity = human_size(t["capacity_bytes"]) if t["capacity_bytes"] else "unbounded"
            used = human_size(t["used_bytes"])
        rows.append((name, capacity, used, str(t["chunks"]),
                     str(t["hits"]), str(t["misses"]),
                     "yes" if t["healthy"] else f"no: {t.get('reason', '')}", tier_notes(t)))
    return rows


PEER_COLUMNS = ("peer", "node", "state", "chunks", "link", "lag")


def peer_rows(data: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row of `PEER_COLUMNS` per other agent of the pool (STATS' `peers`; none with
    peers off): its state with the seconds it has left where it ends by itself, the chunks
    listed as its, what its link's batches of reads delivered."""
    rows: list[tuple[str, ...]] = []
    for peer in data.get("peers", []):
        state = str(peer.get("state", ""))
        if peer.get("for_seconds"):
            state += f" ({peer['for_seconds']:.0f} s)"
        rate = peer.get("bytes_per_second")
        rows.append((str(peer.get("peer", "")), str(peer.get("node", "")) or "-", state,
                     str(peer.get("chunks", 0)),
                     "-" if rate is None else f"{human_size(int(rate))}/s",
                     f"{1000 * float(peer.get('lag_seconds', 0.0)):.1f} ms"))
    return rows


def summary(data: dict[str, Any]) -> str:
    leases = data.get("leases", {})
    return (f"clients {data.get('clients', 0)}, read leases {leases.get('read', 0)}, "
            f"write leases {leases.get('write', 0)}, pins {data.get('pins', 0)}, "
            f"agent {data.get('agent_version', '?')}")


def _columns(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    rows = [header, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def plain(data: dict[str, Any]) -> str:
    """The whole view as plain text: the title, aligned columns of the tiers (and of the
    peers, with peers on), the summary line."""
    lines = [title(data), *_columns(COLUMNS, tier_rows(data))]
    peers = peer_rows(data)
    if peers:
        lines += _columns(PEER_COLUMNS, peers)
    lines.append(summary(data))
    return "\n".join(lines)
