"""Prometheus metrics of one agent (names and meanings in docs/metrics.md).

Counters are bound per label value up front, so every series exists from the
start (dashboards and alerts see a 0, not an absent series) and the hot path
does no label lookups. What the stores hold and count themselves (used bytes,
chunks, clients, leases, per-tier hits and misses) is read from them at scrape
time by a collector that names and fills its families in one place (like
prometheus_client's gc_collector); nothing reads a metric object's value back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from . import __version__
from .config import TIER_ORDER, TierName
from .constants import PEER_TIER, PEER_TIER_CODE, TIER_CODES
from .protocol import ErrorCode, Op

EVICTION_REASONS = ("watermark", "capacity", "ttl", "quota")
ERROR_KINDS = ("read", "write", "delete", "full", "timeout")
SHARED_OPS = ("get", "put", "head", "delete", "list")
disable_created_metrics()  # type: ignore[no-untyped-call]  # *_created series double the scrape for no use here

_LATENCY_BUCKETS = (
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    100e-3, 250e-3, 1.0,
)


@dataclass(frozen=True, slots=True)
class Sample:
    """One value of a series the collector fills at scrape time."""

    name: str
    """Family name; a counter's series is exposed as `<name>_total`."""
    doc: str
    labels: dict[str, str] = field(default_factory=dict)
    value: float = 0
    counter: bool = False


Sampler = Callable[[], Iterable[Sample]]


class _StateCollector(Collector):
    """Families computed from live state at scrape time. Samples of one series (the same
    name and labels, e.g. a counter kept per tenant's store) are added up."""

    def __init__(self, pool: str, sample: Sampler) -> None:
        self.pool = pool
        self.sample = sample

    def collect(self) -> Iterable[Metric]:
        families: dict[str, tuple[Sample, dict[tuple[str, ...], float]]] = {}
        for s in self.sample():
            _, series = families.setdefault(s.name, (s, {}))
            values = (self.pool, *s.labels.values())
            series[values] = series.get(values, 0) + s.value
        out: list[Metric] = []
        for first, series in families.values():
            names = ["pool", *first.labels.keys()]
            fam: CounterMetricFamily | GaugeMetricFamily
            if first.counter:
                fam = CounterMetricFamily(first.name, first.doc, labels=names)
            else:
                fam = GaugeMetricFamily(first.name, first.doc, labels=names)
            for values, value in series.items():
                fam.add_metric(list(values), value)
            out.append(fam)
        return out


class AgentMetrics:
    def __init__(self, pool: str, node: str = "") -> None:
        self.registry = CollectorRegistry()
        self.pool = pool
        r = self.registry
        p = ["pool"]

        def per_tier(metric: Counter) -> dict[TierName, Counter]:
            return {t: metric.labels(pool, t) for t in TIER_ORDER}

        self.read_bytes = per_tier(Counter("kvpool_tier_read_bytes", "Chunk bytes read",
                                           [*p, "tier"], registry=r))
        self.written_bytes = per_tier(Counter("kvpool_tier_written_bytes",
                                              "Chunk bytes written", [*p, "tier"], registry=r))
        self.demotions = per_tier(Counter("kvpool_tier_demotions",
                                          "Chunks moved to the next slower tier", [*p, "tier"],
                                          registry=r))
        self.promotions = per_tier(Counter("kvpool_tier_promotions",
                                           "Chunks copied up into DRAM after a hit", [*p, "tier"],
                                           registry=r))
        self.prefetches = per_tier(Counter("kvpool_tier_prefetches",
                                           "Chunks loaded ahead into DRAM", [*p, "tier"],
                                           registry=r))
        self.integrity_failures = per_tier(Counter(
            "kvpool_integrity_failures", "Chunks whose checksum did not match", [*p, "tier"],
            registry=r))
        evictions = Counter("kvpool_tier_evictions", "Chunks evicted", [*p, "tier", "reason"],
                            registry=r)
        self.evictions = {(t, why): evictions.labels(pool, t, why)
                          for t in TIER_ORDER for why in EVICTION_REASONS}
        errors = Counter("kvpool_tier_errors", "Tier I/O failures", [*p, "tier", "kind"],
                         registry=r)
        self.tier_errors = {(t, k): errors.labels(pool, t, k)
                            for t in TIER_ORDER for k in ERROR_KINDS}
        self.lookups = Counter("kvpool_lookups", "LOOKUP requests", p, registry=r).labels(pool)
        self.lookup_keys = Counter("kvpool_lookup_keys", "Keys asked for in LOOKUP requests", p,
                                   registry=r).labels(pool)
        ops = Counter("kvpool_ops", "Requests by op and result", [*p, "op", "result"], registry=r)
        self.ops_ok = {op: ops.labels(pool, op.name.lower(), "ok") for op in Op}
        self._ops = ops
        for op in Op:
            for code in ErrorCode:
                ops.labels(pool, op.name.lower(), code.name.lower())
        latency = Histogram("kvpool_op_duration_seconds", "Request latency", [*p, "op"],
                            buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = {op: latency.labels(pool, op.name.lower()) for op in Op}
        self.connections_refused = Counter(
            "kvpool_connections_refused", "Clients refused: their space held its share of "
            "the agent's file descriptors", p, registry=r).labels(pool)
        reloads = Counter("kvpool_policy_reloads", "Policy reloads", [*p, "result"], registry=r)
        self.policy_reloads = {res: reloads.labels(pool, res) for res in ("ok", "invalid")}
        self.shared_dropped = Counter("kvpool_shared_dropped_writes",
                                      "Write-behind uploads dropped", p, registry=r).labels(pool)
        shared_req = Counter("kvpool_shared_requests", "Requests to the shared store",
                             [*p, "op", "result"], registry=r)
        self.shared_requests = {(op, res): shared_req.labels(pool, op, res)
                                for op in SHARED_OPS for res in ("ok", "error")}
        shared_lat = Histogram("kvpool_shared_request_duration_seconds",
                               "Shared store request latency", [*p, "op"], registry=r)
        self.shared_latency = {op: shared_lat.labels(pool, op) for op in SHARED_OPS}
        self.events_published = Counter(
            "kvpool_events_published", "KV events published to routers (each once, whatever "
            "the topics it went to)", p, registry=r).labels(pool)
        self.events_dropped = Counter(
            "kvpool_events_dropped", "KV events dropped: the publishing queue was full", p,
            registry=r).labels(pool)
        tokens = Counter("kvpool_tokens", "Prefill tokens LOOKUPs asked for: hits by the tier "
                         "holding them, misses (tier none)", [*p, "result", "tier"], registry=r)
        self._token_hits = [(TIER_CODES[t], tokens.labels(pool, "hit", t)) for t in TIER_ORDER]
        self._token_hits.append((PEER_TIER_CODE, tokens.labels(pool, "hit", PEER_TIER)))
        self._token_misses = tokens.labels(pool, "miss", "none")
        Gauge("kvpool_agent_info", "Agent build and placement", [*p, "version", "node"],
              registry=r).labels(pool, __version__, node).set(1)

    def op_error(self, op: Op | int, code: ErrorCode) -> None:
        name = op.name.lower() if isinstance(op, Op) else "unknown"
        self._ops.labels(self.pool, name, code.name.lower()).inc()

    def lookup_tokens(self, tiers: bytes, missed: int, chunk_tokens: int) -> None:
        """Count a LOOKUP's prefill tokens: `tiers` its reply's tier codes (one per hit
        chunk), `missed` the chunks past the hit prefix."""
        for code, counter in self._token_hits:
            n = tiers.count(code)
            if n:
                counter.inc(n * chunk_tokens)
        if missed:
            self._token_misses.inc(missed * chunk_tokens)

    def add_state(self, sample: Sampler) -> None:
        """Serve what `sample` yields at every scrape (the stores' state and counts)."""
        self.registry.register(_StateCollector(self.pool, sample))
