"""The kvpool Grafana dashboard, generated as JSON.

The chart ships the output of this module as `charts/kvpool/files/kvpool-dashboard.json`
(a test fails when the committed file differs). Regenerate it with

    python -m kvpool.operator.dashboard > charts/kvpool/files/kvpool-dashboard.json

Every query reads the metrics of `docs/metrics.md`. Agent series carry `pool` (from the
agent) and `namespace`, `node` and `job="kvpool-agent"` (from the chart's PodMonitor);
template variables `$namespace`, `$pool` and `$node` filter them. Counters are read with
`rate(...[$__rate_interval])`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvpool.agent.constants import AGENT_JOB

from .generated import print_or_write

DASHBOARD_UID = "kvpool-overview"
DASHBOARD_TITLE = "kvpool / Tiered KV-cache"

SEL = 'namespace=~"$namespace", pool=~"$pool", node=~"$node"'
"""Label matchers every agent query applies."""
RI = "$__rate_interval"
_TTL = 'reason="ttl"'
_HIT = 'result="hit"'
_MISS = 'result="miss"'


def _rate(metric: str, extra: str = "") -> str:
    matchers = f"{SEL}, {extra}" if extra else SEL
    return f"rate({metric}{{{matchers}}}[{RI}])"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 12
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def _q(expr: str, legend: str) -> Query:
    return Query(expr=expr, legend=legend)


ROWS: tuple[Row, ...] = (
    Row(
        "Overview",
        (
            Panel(
                "Agent up per node",
                "1 when Prometheus scraped the pool's agent on the node, 0 when the scrape "
                "failed (agent down or unreachable). The pool label comes from the agent's "
                "last reported info within the past hour.",
                (
                    _q(
                        f'up{{job="{AGENT_JOB}", namespace=~"$namespace", node=~"$node"}}'
                        " * on (namespace, instance) group_left (pool)"
                        " max by (namespace, instance, pool) (last_over_time("
                        f'kvpool_agent_info{{namespace=~"$namespace", pool=~"$pool"}}[1h]))',
                        "{{pool}} on {{node}}",
                    ),
                ),
                unit="none",
                width=8,
                extra={"min": 0, "max": 1},
            ),
            Panel(
                "Block hit ratio (overall)",
                "Looked-up keys (chunks) found in any tier over keys asked for. Every chunk "
                "holds the pool's chunkTokens tokens, so this is also the token hit ratio of "
                "the cached prefix.",
                (
                    _q(
                        f"sum by (namespace, pool) ({_rate('kvpool_tier_hits_total')})"
                        f" / sum by (namespace, pool) ({_rate('kvpool_lookup_keys_total')})",
                        "{{pool}}",
                    ),
                ),
                unit="percentunit",
                width=8,
                extra={"min": 0, "max": 1},
            ),
            Panel(
                "Operator reconcile errors",
                "Reconcile errors per second of the kvpool operator, by resource kind and "
                "reason. Not filtered by pool: the operator serves every pool.",
                (
                    _q(
                        "sum by (kind, reason) "
                        f"(rate(kvpool_operator_reconcile_errors_total[{RI}]))",
                        "{{kind}}: {{reason}}",
                    ),
                ),
                unit="ops",
                width=8,
            ),
        ),
    ),
    Row(
        "Tiers",
        (
            Panel(
                "Tier used vs capacity",
                "Bytes of chunks held in each tier against its configured capacity, summed "
                "over the selected nodes.",
                (
                    _q(
                        f"sum by (pool, tier) (kvpool_tier_used_bytes{{{SEL}}})",
                        "{{pool}} {{tier}} used",
                    ),
                    _q(
                        f"sum by (pool, tier) (kvpool_tier_capacity_bytes{{{SEL}}})",
                        "{{pool}} {{tier}} capacity",
                    ),
                ),
                unit="bytes",
            ),
            Panel(
                "Chunks per tier",
                "Chunks held in each tier, summed over the selected nodes.",
                (_q(f"sum by (pool, tier) (kvpool_tier_chunks{{{SEL}}})", "{{pool}} {{tier}}"),),
            ),
            Panel(
                "Block hit ratio per tier (share of looked-up keys)",
                "Which tier served the hits: keys found in the tier over all keys looked up. "
                "The tiers add up to the overall hit ratio, also shown.",
                (
                    _q(
                        f"sum by (namespace, pool, tier) ({_rate('kvpool_tier_hits_total')})"
                        " / on (namespace, pool) group_left"
                        f" sum by (namespace, pool) ({_rate('kvpool_lookup_keys_total')})",
                        "{{pool}} {{tier}}",
                    ),
                    _q(
                        f"sum by (namespace, pool) ({_rate('kvpool_tier_hits_total')})"
                        f" / sum by (namespace, pool) ({_rate('kvpool_lookup_keys_total')})",
                        "{{pool}} overall",
                    ),
                ),
                unit="percentunit",
                extra={"min": 0, "max": 1},
            ),
            Panel(
                "Tier hit ratio (of keys reaching the tier)",
                "Hits over hits plus misses within each tier: how often a key that got as far "
                "as this tier was found there.",
                (
                    _q(
                        f"sum by (pool, tier) ({_rate('kvpool_tier_hits_total')})"
                        f" / (sum by (pool, tier) ({_rate('kvpool_tier_hits_total')})"
                        f" + sum by (pool, tier) ({_rate('kvpool_tier_misses_total')}))",
                        "{{pool}} {{tier}}",
                    ),
                ),
                unit="percentunit",
                extra={"min": 0, "max": 1},
            ),
            Panel(
                "Hits and misses per tier",
                "Looked-up keys per second found (hits) and not found (misses) in each tier.",
                (
                    _q(
                        f"sum by (pool, tier) ({_rate('kvpool_tier_hits_total')})",
                        "{{pool}} {{tier}} hits",
                    ),
                    _q(
                        f"sum by (pool, tier) ({_rate('kvpool_tier_misses_total')})",
                        "{{pool}} {{tier}} misses",
                    ),
                ),
                unit="ops",
            ),
            Panel(
                "Bytes per second in and out per tier",
                "Chunk bytes written into (in) and read out of (out) each tier, including "
                "promotions and demotions.",
                (
                    _q(
                        f"sum by (pool, tier) ({_rate('kvpool_tier_written_bytes_total')})",
                        "{{pool}} {{tier}} in",
                    ),
                    _q(
                        f"sum by (pool, tier) ({_rate('kvpool_tier_read_bytes_total')})",
                        "{{pool}} {{tier}} out",
                    ),
                ),
                unit="Bps",
            ),
            Panel(
                "Evictions by reason",
                "Chunks evicted per second by tier and reason (watermark, capacity, ttl, quota).",
                (
                    _q(
                        f"sum by (pool, tier, reason) ({_rate('kvpool_tier_evictions_total')})",
                        "{{pool}} {{tier}} {{reason}}",
                    ),
                ),
                unit="ops",
            ),
            Panel(
                "Demotions, promotions and prefetches",
                "Chunks per second moved down from each tier (demotions), copied up into DRAM "
                "after a hit (promotions) and loaded ahead of a request (prefetches).",
                (
                    _q(
                        f"sum by (pool, tier) ({_rate('kvpool_tier_demotions_total')})",
                        "{{pool}} demoted from {{tier}}",
                    ),
                    _q(
                        f"sum by (pool, tier) ({_rate('kvpool_tier_promotions_total')})",
                        "{{pool}} promoted from {{tier}}",
                    ),
                    _q(
                        f"sum by (pool, tier) ({_rate('kvpool_tier_prefetches_total')})",
                        "{{pool}} prefetched from {{tier}}",
                    ),
                ),
                unit="ops",
            ),
            Panel(
                "TTL expiries",
                "Chunks per second that expired because they were not read within the "
                "policy's TTL (evictions with reason ttl).",
                (
                    _q(
                        f"sum by (pool, tier) ({_rate('kvpool_tier_evictions_total', _TTL)})",
                        "{{pool}} {{tier}}",
                    ),
                ),
                unit="ops",
            ),
            Panel(
                "Tier health",
                "1 when the tier serves, 0 when it is failing, lowest over the selected nodes.",
                (_q(f"min by (pool, tier) (kvpool_tier_healthy{{{SEL}}})", "{{pool}} {{tier}}"),),
                unit="none",
                extra={"min": 0, "max": 1},
            ),
        ),
    ),
    Row(
        "Operations and clients",
        (
            Panel(
                "Op latency p50 / p99",
                "Time from a request's arrival at the agent to its reply, by op.",
                (
                    _q(
                        "histogram_quantile(0.5, sum by (op, le) "
                        f"({_rate('kvpool_op_duration_seconds_bucket')}))",
                        "{{op}} p50",
                    ),
                    _q(
                        "histogram_quantile(0.99, sum by (op, le) "
                        f"({_rate('kvpool_op_duration_seconds_bucket')}))",
                        "{{op}} p99",
                    ),
                ),
                unit="s",
            ),
            Panel(
                "Requests by op and result",
                "Requests per second the agents answered, by op and result.",
                (
                    _q(
                        f"sum by (op, result) ({_rate('kvpool_ops_total')})",
                        "{{op}} {{result}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Clients and leases",
                "Connected clients and open read (ACQUIRE) and write (ALLOC) leases.",
                (
                    _q(f"sum by (pool) (kvpool_clients{{{SEL}}})", "{{pool}} clients"),
                    _q(
                        f"sum by (pool, kind) (kvpool_leases{{{SEL}}})",
                        "{{pool}} {{kind}} leases",
                    ),
                ),
            ),
            Panel(
                "DRAM locked bytes",
                "Arena bytes locked in RAM with mlock against the DRAM capacity; locked below "
                "capacity means the arena may be swapped out.",
                (
                    _q(f"sum by (pool) (kvpool_dram_locked_bytes{{{SEL}}})", "{{pool}} locked"),
                    _q(
                        f'sum by (pool) (kvpool_tier_capacity_bytes{{{SEL}, tier="dram"}})',
                        "{{pool}} DRAM capacity",
                    ),
                ),
                unit="bytes",
            ),
        ),
    ),
    Row(
        "Shared tier (G4)",
        (
            Panel(
                "Shared tier health per node",
                "1 when the node's agent reaches the shared store, 0 when it does not.",
                (
                    _q(
                        f'min by (pool, node) (kvpool_tier_healthy{{{SEL}, tier="shared"}})',
                        "{{pool}} on {{node}}",
                    ),
                ),
                unit="none",
                width=8,
                extra={"min": 0, "max": 1},
            ),
            Panel(
                "Write-behind queue depth and dropped writes",
                "Uploads waiting in the write-behind queue, and uploads dropped per second "
                "(queue full or store unreachable).",
                (
                    _q(
                        f"sum by (pool, node) (kvpool_shared_queue_depth{{{SEL}}})",
                        "{{pool}} on {{node}} queued",
                    ),
                    _q(
                        f"sum by (pool, node) ({_rate('kvpool_shared_dropped_writes_total')})",
                        "{{pool}} on {{node}} dropped/s",
                    ),
                ),
                width=8,
            ),
            Panel(
                "Store requests and p99 latency",
                "Requests per second to the shared store by op and result, and their p99.",
                (
                    _q(
                        f"sum by (op, result) ({_rate('kvpool_shared_requests_total')})",
                        "{{op}} {{result}}",
                    ),
                    _q(
                        "histogram_quantile(0.99, sum by (op, le) "
                        f"({_rate('kvpool_shared_request_duration_seconds_bucket')}))",
                        "{{op}} p99 (s)",
                    ),
                ),
                width=8,
            ),
        ),
    ),
    Row(
        "Value and KV events",
        (
            Panel(
                "Tokens served from the pool",
                "Prefill tokens per second that lookups found in the pool, by the tier that "
                "holds them: tokens the engines load instead of recomputing. Missed tokens "
                "(tier none) are those past the cached prefix, which the engines compute.",
                (
                    _q(
                        "sum by (pool, tier) "
                        f"({_rate('kvpool_tokens_total', _HIT)})",
                        "{{pool}} from {{tier}}",
                    ),
                    _q(
                        "sum by (pool) "
                        f"({_rate('kvpool_tokens_total', _MISS)})",
                        "{{pool}} missed",
                    ),
                ),
                unit="short",
                width=8,
            ),
            Panel(
                "Token hit ratio",
                "Prefill tokens served from the pool over all prefill tokens looked up: the "
                "share of prefill compute the pool saves.",
                (
                    _q(
                        "sum by (pool) "
                        f"({_rate('kvpool_tokens_total', _HIT)})"
                        f" / sum by (pool) ({_rate('kvpool_tokens_total')})",
                        "{{pool}}",
                    ),
                ),
                unit="percentunit",
                width=8,
                extra={"min": 0, "max": 1},
            ),
            Panel(
                "KV events per second",
                "KV events (BlockStored, BlockRemoved, AllBlocksCleared) each agent "
                "published to routers per second, counted once whatever the topics they "
                "went to; 0 where the pool's spec.events is off.",
                (
                    _q(
                        f"sum by (pool, node) ({_rate('kvpool_events_published_total')})",
                        "{{pool}} on {{node}}",
                    ),
                ),
                unit="ops",
                width=8,
            ),
            Panel(
                "KV events dropped",
                "KV events per second each agent dropped because its publishing queue was "
                "full: routers then see a stale view of the node (alert "
                "KVPoolEventsDropped).",
                (
                    _q(
                        f"sum by (pool, node) ({_rate('kvpool_events_dropped_total')})",
                        "{{pool}} on {{node}}",
                    ),
                ),
                unit="ops",
                width=8,
            ),
        ),
    ),
    Row(
        "Peer tier",
        (
            Panel(
                "Peer bytes per second",
                "Chunk bytes each agent read from (read) and served to (served) each of its "
                "peers per second; nothing where the pool's spec.peers is off.",
                (
                    _q(
                        "sum by (pool, node, peer, direction) "
                        f"({_rate('kvpool_peer_bytes_total')})",
                        "{{node}} {{direction}} {{peer}}",
                    ),
                ),
                unit="Bps",
                width=6,
            ),
            Panel(
                "Peer reads by result",
                "Chunk reads between agents and their peers per second, by direction and "
                "result: ok, absent (a stale directory entry), error, timeout (past "
                "peers.timeout; the read fell back to the shared tier: alert "
                "KVPoolPeerReadsTimingOut), corrupt (bytes that failed their checksum: alert "
                "KVPoolPeerBadChecksums).",
                (
                    _q(
                        "sum by (pool, node, peer, direction, result) "
                        f"({_rate('kvpool_peer_requests_total')})",
                        "{{node}} {{direction}} {{peer}} {{result}}",
                    ),
                ),
                unit="ops",
                width=6,
            ),
            Panel(
                "Peer read latency p50 / p99",
                "Time of a chunk read from a peer, from asking to verified bytes (read), and "
                "of one served to a peer (served), by direction.",
                (
                    _q(
                        "histogram_quantile(0.5, sum by (pool, direction, le) "
                        f"({_rate('kvpool_peer_request_duration_seconds_bucket')}))",
                        "{{pool}} {{direction}} p50",
                    ),
                    _q(
                        "histogram_quantile(0.99, sum by (pool, direction, le) "
                        f"({_rate('kvpool_peer_request_duration_seconds_bucket')}))",
                        "{{pool}} {{direction}} p99",
                    ),
                ),
                unit="s",
                width=6,
            ),
            Panel(
                "Peer link speed",
                "What each agent's batches of chunk reads from each peer delivered (bytes of "
                "replies that came whole over the time from the batch's write, averaged over "
                "the last batches): a batch asks for at most what this moves in half of "
                "peers.timeout, so a link far below the others' is one whose reads come in "
                "small batches (docs/cross-node.md, \"Slow links\").",
                (
                    _q(
                        f"max by (pool, node, peer) (kvpool_peer_link_bytes_per_second{{{SEL}}})",
                        "{{node}} from {{peer}}",
                    ),
                ),
                unit="Bps",
                width=6,
            ),
            Panel(
                "Peer DELETEs by result",
                "DELETEs of a key between agents per second (a client's DELETE reaching the "
                "copies its peers hold), by direction and result: ok, absent (not held "
                "there), refused (a tenant space the peer lacks, or it does not follow the "
                "sender), error (not delivered yet: sent again when the peer is back), "
                "dropped (too many waited for an unreachable peer: it keeps its copy; alert "
                "KVPoolPeerDeletesDropped).",
                (
                    _q(
                        "sum by (pool, node, peer, direction, result) "
                        f"({_rate('kvpool_peer_deletes_total')})",
                        "{{node}} {{direction}} {{peer}} {{result}}",
                    ),
                ),
                unit="ops",
                width=6,
            ),
            Panel(
                "Peer DELETEs waiting",
                "DELETEs each agent holds for a peer not reached yet (unreachable, or not "
                "following the sender), or for a node away: its address no longer listed, "
                "they wait for it at any address for an hour (peer_node: the peer's node). "
                "Above zero for long: a node keeps deleted chunks (alert "
                "KVPoolPeerDeletesDropped once they are dropped).",
                (
                    _q(
                        "sum by (pool, node, peer, peer_node) "
                        f"(kvpool_peer_deletes_waiting{{{SEL}}})",
                        "{{node}} -> {{peer_node}} {{peer}}",
                    ),
                ),
                unit="none",
                width=6,
            ),
            Panel(
                "Peer directory",
                "Remote chunks each agent's directory says its peers hold (what LOOKUP can "
                "count as tier peer).",
                (
                    _q(f"sum by (pool, node) (kvpool_peer_directory_entries{{{SEL}}})",
                       "{{node}} remote chunks"),
                ),
                width=6,
            ),
            Panel(
                "Peer directory use",
                "Each agent's fullest peer directory (one per tenant space) against its cap, "
                "peers.maxEntries (the pool's spec.peers.remoteChunks); at 100% a remote "
                "chunk announced is not listed (Peer directory full). Nothing where the cap "
                "is unset.",
                (
                    _q(
                        f"max by (pool, node) (kvpool_peer_directory_entries{{{SEL}}}"
                        f" / kvpool_peer_directory_capacity_entries{{{SEL}}})",
                        "{{node}} used",
                    ),
                ),
                unit="percentunit",
                width=6,
                extra={"min": 0, "max": 1},
            ),
            Panel(
                "Peer directory full",
                "Remote chunks per second a peer announced and each agent's directory did not "
                "list, holding peers.maxEntries already: each is a cross-node hit lost, its "
                "LOOKUP going on to the shared tier (alert KVPoolPeerDirectoryFull: raise "
                "spec.peers.remoteChunks).",
                (
                    _q(
                        f"sum by (pool, node) ({_rate('kvpool_peer_directory_full_total')})",
                        "{{node}} not listed",
                    ),
                ),
                unit="ops",
                width=6,
            ),
            Panel(
                "Peer directory lag",
                "Seconds between a peer's last inventory message (a change or a heartbeat) "
                "being sent and its arrival, per node and peer.",
                (
                    _q(f"max by (pool, node, peer) (kvpool_peer_directory_lag_seconds{{{SEL}}})",
                       "{{node}} from {{peer}}"),
                ),
                unit="s",
                width=6,
            ),
            Panel(
                "Peers followed",
                "1 while the agent on the node follows the peer's inventory (connected, "
                "authenticated, synced), 0 while the peer is unreachable or refused (alert "
                "KVPoolPeerUnreachable).",
                (_q(f"max by (pool, node, peer) (kvpool_peer_up{{{SEL}}})",
                    "{{node}} follows {{peer}}"),),
                unit="none",
                width=8,
                extra={"min": 0, "max": 1},
            ),
            Panel(
                "Peer connections refused",
                "Peer connections per second refused because a side did not prove the pool's "
                "secret, or closed for a frame that breaks the peer protocol: a "
                "misconfigured agent, or something on the network that is not one.",
                (
                    _q(f"sum by (pool, node) ({_rate('kvpool_peer_auth_failures_total')})",
                       "{{node}} secret not proven"),
                    _q(f"sum by (pool, node) ({_rate('kvpool_peer_protocol_errors_total')})",
                       "{{node}} protocol errors"),
                ),
                unit="ops",
                width=8,
            ),
            Panel(
                "Peer certificate expires in",
                "With TLS between the agents (spec.peers.tls): how long until the certificate "
                "each node's agent shows its peers expires, the one in use (a renewed one is "
                "taken within seconds of the kubelet updating the files). Alert "
                "KVPoolPeerCertificateExpiring a week before.",
                (_q("min by (pool, node) "
                    f"(kvpool_peer_tls_certificate_expiry_timestamp_seconds{{{SEL}}}) - time()",
                    "{{node}}"),),
                unit="s",
                width=8,
            ),
            Panel(
                "Hand-off pushes by result",
                "Hand-off pushes (a put hinted with the node that will read it, pushed there "
                "after COMMIT) per second, by direction (sent by a producer's agent, received "
                "by a consumer's) and result: ok, held, refused (the receiver's pin quota, a "
                "tenant or sender it lacks), error, timeout, auth, unreachable, unknown (no "
                "peer has the hinted name), dropped (the push queue was full). Alert "
                "KVPoolHandoffFailing.",
                (
                    _q(
                        "sum by (pool, node, direction, result) "
                        f"({_rate('kvpool_peer_pushes_total')})",
                        "{{node}} {{direction}} {{result}}",
                    ),
                ),
                unit="ops",
                width=6,
            ),
            Panel(
                "Hand-off push latency p50 / p99",
                "Time of a push the receiver answered, from the offer to its answer (its "
                "read of the chunk, verified and stored, included), on the sending node.",
                (
                    _q(
                        "histogram_quantile(0.5, sum by (pool, node, le) "
                        f"({_rate('kvpool_peer_push_duration_seconds_bucket')}))",
                        "{{node}} p50",
                    ),
                    _q(
                        "histogram_quantile(0.99, sum by (pool, node, le) "
                        f"({_rate('kvpool_peer_push_duration_seconds_bucket')}))",
                        "{{node}} p99",
                    ),
                ),
                unit="s",
                width=6,
            ),
            Panel(
                "Hand-off pinned bytes",
                "Arena bytes each receiving node holds pinned for chunks pushed to it and "
                "not read yet (at most peers.handoffShare of its arena; a push past it is "
                "refused).",
                (
                    _q(f"sum by (pool, node) (kvpool_peer_handoff_pinned_bytes{{{SEL}}})",
                       "{{node}} pinned"),
                ),
                unit="bytes",
                width=6,
            ),
            Panel(
                "Hand-off pins ended",
                "Pins of pushed chunks ended per second on each receiving node: read (the "
                "consumer read it: the hand-off worked), expired (unread for "
                "peers.handoffTtl: the consumer ran elsewhere, or never came), deleted.",
                (
                    _q(
                        f"sum by (pool, node, end) ({_rate('kvpool_peer_handoff_pins_total')})",
                        "{{node}} {{end}}",
                    ),
                ),
                unit="ops",
                width=6,
            ),
        ),
    ),
    Row(
        "Integrity and errors",
        (
            Panel(
                "Integrity failures",
                "Chunks whose checksum did not match, per tier; each was quarantined and "
                "served as a miss.",
                (
                    _q(
                        "sum by (pool, tier) "
                        f"(increase(kvpool_integrity_failures_total{{{SEL}}}[{RI}]))",
                        "{{pool}} {{tier}}",
                    ),
                ),
                width=8,
            ),
            Panel(
                "Tier I/O errors",
                "I/O failures per second by tier and kind (read, write, delete, full, timeout).",
                (
                    _q(
                        f"sum by (pool, tier, kind) ({_rate('kvpool_tier_errors_total')})",
                        "{{pool}} {{tier}} {{kind}}",
                    ),
                ),
                unit="ops",
                width=8,
            ),
            Panel(
                "Policy reloads",
                "Policy reloads per second, ok or invalid (an invalid policy keeps the last "
                "good one).",
                (
                    _q(
                        f"sum by (pool, result) ({_rate('kvpool_policy_reloads_total')})",
                        "{{pool}} {{result}}",
                    ),
                ),
                unit="ops",
                width=8,
            ),
        ),
    ),
)

_PANEL_HEIGHT = 8


def _datasource() -> dict[str, str]:
    return {"type": "prometheus", "uid": "${datasource}"}


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": _datasource(),
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "hide": 0,
    }


def _templating() -> dict[str, Any]:
    return {
        "list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
                "hide": 0,
                "refresh": 1,
                "regex": "",
            },
            _variable(
                "namespace", "Namespace", "label_values(kvpool_tier_capacity_bytes, namespace)"
            ),
            _variable(
                "pool",
                "Pool",
                'label_values(kvpool_tier_capacity_bytes{namespace=~"$namespace"}, pool)',
            ),
            _variable(
                "node",
                "Node",
                'label_values(kvpool_tier_capacity_bytes{namespace=~"$namespace", '
                'pool=~"$pool"}, node)',
            ),
        ]
    }


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    defaults.update(panel.extra)
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": _datasource(),
        "gridPos": {"h": _PANEL_HEIGHT, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {
                "datasource": _datasource(),
                "expr": q.expr,
                "legendFormat": q.legend,
                "range": True,
                "refId": chr(ord("A") + i),
            }
            for i, q in enumerate(panel.queries)
        ],
    }


def _panels() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    panel_id = 1
    y = 0
    for row in ROWS:
        out.append(
            {
                "id": panel_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id += 1
        y += 1
        x = 0
        for panel in row.panels:
            if x + panel.width > 24:
                x = 0
                y += _PANEL_HEIGHT
            out.append(_panel_json(panel, panel_id, x, y))
            panel_id += 1
            x += panel.width
        y += _PANEL_HEIGHT
    return out


def dashboard() -> dict[str, Any]:
    """The dashboard as a Grafana JSON model (import it, or let the sidecar load it)."""
    return {
        "uid": DASHBOARD_UID,
        "title": DASHBOARD_TITLE,
        "description": "Tier health, hit ratio, traffic and errors of kvpool pools.",
        "tags": ["kvpool"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": _templating(),
        "panels": _panels(),
    }


def render() -> str:
    """The dashboard JSON text exactly as committed in the chart."""
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) for every query of every panel."""
    return [(p.title, q.expr) for row in ROWS for p in row.panels for q in p.queries]


def main(argv: list[str] | None = None) -> int:
    """`python -m kvpool.operator.dashboard [FILE]`: print the dashboard, or write FILE."""
    return print_or_write(render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
