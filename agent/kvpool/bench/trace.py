"""Request traces in Mooncake's JSONL format, and what an ideal cache would hit.

Each line: `{"timestamp": ms, "input_length": n, "output_length": n,
"hash_ids": [...]}` where `hash_ids` are the prompt's prefix blocks (512
tokens each in the released traces); equal ids are the same reusable block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

BUNDLED_TRACE = "mooncake_synthetic_trace.jsonl"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    blocks: tuple[int, ...]


def bundled_trace_path() -> Path:
    return Path(str(resources.files("kvpool.bench.data").joinpath(BUNDLED_TRACE)))


def load_trace(path: Path | None = None, limit: int | None = None) -> list[TraceRequest]:
    path = path or bundled_trace_path()
    out: list[TraceRequest] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                out.append(TraceRequest(int(rec.get("timestamp", 0)),
                                        int(rec.get("input_length", 0)),
                                        int(rec.get("output_length", 0)),
                                        tuple(int(b) for b in rec["hash_ids"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record: {e}") from e
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{path}: the trace has no requests")
    return out


def distinct_blocks(trace: list[TraceRequest]) -> int:
    return len({b for r in trace for b in r.blocks})


def block_references(trace: list[TraceRequest]) -> int:
    return sum(len(r.blocks) for r in trace)
