"""kvpool's Prometheus recording rules and alerts, generated as a rule file.

The chart ships the output of this module as `charts/kvpool/files/kvpool-rules.yaml` (a
Prometheus rule file: `groups:`), wrapped into a PrometheusRule by the chart; a test fails
when the committed file differs. Regenerate it with

    python -m kvpool.operator.alerts > charts/kvpool/files/kvpool-rules.yaml

Every alert has a `for:` duration, a `severity` label, and `summary`, `description` and
`runbook_url` annotations; the runbook URL points at the alert's section of `docs/runbook.md`
(its anchor is the alert name in lower case). Agent series carry `pool`, `namespace`, `node`
and `job="kvpool-agent"` (the chart's PodMonitor adds the last three).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from kvpool.agent.constants import AGENT_JOB

from .generated import print_or_write

RUNBOOK_BASE_URL = "https://github.com/kvpool/kvpool/blob/main/docs/runbook.md"
"""Where `docs/runbook.md` is published; the chart's `prometheusRule.runbookBaseURL`
replaces it for a fork or an internal copy of the runbook."""

HIT_RATIO = "kvpool:block_hit_ratio:rate5m"
"""Recording rule: keys found in any tier over keys looked up, per namespace and pool."""
LOOKUP_KEYS = "kvpool:lookup_keys:rate5m"
"""Recording rule: keys looked up per second, per namespace and pool."""

EVICTION_THRASH_FILL = 0.9
"""DRAM fill (used over capacity) from which demotions count as thrash."""
HIT_RATIO_COLLAPSE_FACTOR = 0.5
"""The hit ratio collapsed when it is below this fraction of its own 1 h average."""
HIT_RATIO_MIN_KEYS_PER_SECOND = 1
"""Below this lookup traffic a pool's hit ratio is too noisy to alert on."""

HANDOFF_FAILING_SHARE = 0.1
"""Hand-off pushes of one result other than ok, held or unreachable, over every push a
node sent, from which the hand-off is failing."""
HANDOFF_FAILING_MIN_PUSHES = 10
"""Fewer failed pushes in 10 minutes are too few to alert on (a consumer restarting)."""
_SENT_PUSHES = 'kvpool_peer_pushes_total{direction="sent"}'
PEER_TIMEOUTS_SHARE = 0.05
"""Reads from one peer that timed out, over every read from it, from which its reads
keep timing out (a stopped peer costs one timeout a window: a few; a link too slow for
peers.timeout costs every window some)."""
PEER_TIMEOUTS_MIN = 10
"""Fewer timed-out reads in 10 minutes are too few to alert on (a peer restarting)."""
CERTIFICATE_EXPIRY_WARNING_DAYS = 7
"""Days before the peer TLS certificate in use expires that it is an alert: cert-manager
renews a 90-day certificate 30 days ahead, so one a week from expiry was not renewed, or
its renewal did not reach the agent."""
_PEER_READS = 'kvpool_peer_requests_total{direction="read"}'
_PEER_TIMEOUTS = 'kvpool_peer_requests_total{direction="read", result="timeout"}'
_FAILED_PUSHES = 'kvpool_peer_pushes_total{direction="sent", result!~"ok|held|unreachable"}'


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str

    @property
    def runbook_url(self) -> str:
        return f"{RUNBOOK_BASE_URL}#{self.name.lower()}"

    def rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook_url": self.runbook_url,
            },
        }


RECORDING_RULES: tuple[tuple[str, str], ...] = (
    (
        LOOKUP_KEYS,
        "sum by (namespace, pool) (rate(kvpool_lookup_keys_total[5m]))",
    ),
    (
        HIT_RATIO,
        "sum by (namespace, pool) (rate(kvpool_tier_hits_total[5m]))\n"
        "/\n"
        "sum by (namespace, pool) (rate(kvpool_lookup_keys_total[5m]))",
    ),
)

AGENT_ALERTS: tuple[Alert, ...] = (
    Alert(
        name="KVPoolAgentDown",
        expr=f'up{{job="{AGENT_JOB}"}} == 0',
        for_="5m",
        severity="critical",
        summary="A kvpool agent is down on a node.",
        description=(
            "Prometheus has failed to scrape the kvpool agent {{ $labels.pod }} on node "
            "{{ $labels.node }} (namespace {{ $labels.namespace }}) for 5 minutes. Inference "
            "pods on that node cannot reach their KV-cache and recompute every prefix."
        ),
    ),
    Alert(
        name="KVPoolTierUnhealthy",
        expr='kvpool_tier_healthy{tier!="shared"} == 0',
        for_="5m",
        severity="warning",
        summary="A local kvpool tier is failing.",
        description=(
            "The {{ $labels.tier }} tier of pool {{ $labels.pool }} on node {{ $labels.node }} "
            "has been unhealthy for 5 minutes; the agent serves from its other tiers."
        ),
    ),
    Alert(
        name="KVPoolSharedTierUnreachable",
        expr='kvpool_tier_healthy{tier="shared"} == 0',
        for_="5m",
        severity="warning",
        summary="The shared kvpool tier is unreachable.",
        description=(
            "The agent of pool {{ $labels.pool }} on node {{ $labels.node }} has not reached "
            "the shared store for 5 minutes. Local tiers keep serving; chunks from other nodes "
            "are misses and write-behind uploads are dropped."
        ),
    ),
    Alert(
        name="KVPoolDRAMNotLocked",
        expr=(
            'kvpool_dram_locked_bytes\n< ignoring (tier) kvpool_tier_capacity_bytes{tier="dram"}'
        ),
        for_="15m",
        severity="warning",
        summary="The kvpool DRAM arena is not locked in memory.",
        description=(
            "Only {{ $value | humanize1024 }}B of the DRAM arena of pool {{ $labels.pool }} on "
            "node {{ $labels.node }} are locked with mlock; the rest may be swapped out, making "
            "hits slow. The agent needs the IPC_LOCK capability and a large enough memlock "
            "limit."
        ),
    ),
    Alert(
        name="KVPoolIntegrityFailures",
        expr="increase(kvpool_integrity_failures_total[15m]) > 0",
        for_="1m",
        severity="critical",
        summary="kvpool found corrupted chunks.",
        description=(
            "{{ $value | humanize }} chunks of the {{ $labels.tier }} tier of pool "
            "{{ $labels.pool }} on node {{ $labels.node }} failed their checksum in the last "
            "15 minutes. They were quarantined and served as misses; the storage under the "
            "tier is suspect."
        ),
    ),
    Alert(
        name="KVPoolEvictionThrash",
        expr=(
            # Gauges are per tenant in pools with tenants, the counter per pool: compare
            # the pool's sums (a no-op where there are no tenants).
            f'sum without (tenant) (kvpool_tier_used_bytes{{tier="dram"}})\n'
            f'  > {EVICTION_THRASH_FILL} * sum without (tenant) '
            f'(kvpool_tier_capacity_bytes{{tier="dram"}})\n'
            "and\n"
            'increase(kvpool_tier_demotions_total{tier="dram"}[10m])\n'
            '  > sum without (tenant) (kvpool_tier_chunks{tier="dram"})'
        ),
        for_="15m",
        severity="warning",
        summary="The kvpool DRAM tier is thrashing.",
        description=(
            "The DRAM tier of pool {{ $labels.pool }} on node {{ $labels.node }} has been above "
            f"{EVICTION_THRASH_FILL:.0%} of its capacity for 15 minutes while demoting more "
            "chunks every 10 minutes than it holds: chunks leave DRAM before they are reused. "
            "Grow the DRAM tier or lower the policy's admission into it."
        ),
    ),
    Alert(
        name="KVPoolWriteBehindDrops",
        expr="increase(kvpool_shared_dropped_writes_total[5m]) > 0",
        for_="10m",
        severity="warning",
        summary="kvpool is dropping uploads to the shared tier.",
        description=(
            "The agent of pool {{ $labels.pool }} on node {{ $labels.node }} dropped "
            "{{ $value | humanize }} write-behind uploads in the last 5 minutes and has kept "
            "dropping them for 10 minutes (queue full or store unreachable); other nodes will "
            "miss those chunks."
        ),
    ),
    Alert(
        name="KVPoolEventsDropped",
        expr="increase(kvpool_events_dropped_total[5m]) > 0",
        for_="10m",
        severity="warning",
        summary="kvpool is dropping KV events meant for routers.",
        description=(
            "The agent of pool {{ $labels.pool }} on node {{ $labels.node }} dropped "
            "{{ $value | humanize }} KV events in the last 5 minutes and has kept dropping "
            "them for 10 minutes (its publishing queue is full). KV-aware routers miss "
            "chunks entering and leaving its tiers, so they route on a stale view of the "
            "node until its next AllBlocksCleared."
        ),
    ),
    Alert(
        name="KVPoolPeerUnreachable",
        expr="kvpool_peer_up == 0",
        for_="5m",
        severity="warning",
        summary="A kvpool agent cannot reach one of its peers.",
        description=(
            "The agent of pool {{ $labels.pool }} on node {{ $labels.node }} has not "
            "followed its peer {{ $labels.peer }} for 5 minutes (unreachable, refusing the "
            "connection, or failing the pool's secret). The chunks that peer holds are read "
            "from the shared tier, or missed."
        ),
    ),
    Alert(
        name="KVPoolPeerCertificateExpiring",
        expr=(
            "kvpool_peer_tls_certificate_expiry_timestamp_seconds - time()\n"
            f"  < {CERTIFICATE_EXPIRY_WARNING_DAYS} * 86400"
        ),
        for_="10m",
        severity="warning",
        summary="A kvpool agent's peer TLS certificate expires within "
                f"{CERTIFICATE_EXPIRY_WARNING_DAYS} days.",
        description=(
            "The TLS certificate the agent of pool {{ $labels.pool }} on node "
            "{{ $labels.node }} shows its peers expires in {{ $value | humanizeDuration }}. "
            "Once it has, no new connection between it and the pool's other agents completes "
            "its handshake, and their chunks are read from the shared tier, or missed. Its "
            "renewal failed, or the renewed files do not load on this agent."
        ),
    ),
    Alert(
        name="KVPoolPeerBadChecksums",
        expr='increase(kvpool_peer_requests_total{direction="read", result="corrupt"}[15m]) > 0',
        for_="1m",
        severity="critical",
        summary="A kvpool peer served chunks that failed their checksum.",
        description=(
            "{{ $value | humanize }} chunks the agent of pool {{ $labels.pool }} on node "
            "{{ $labels.node }} read from its peer {{ $labels.peer }} in the last 15 minutes "
            "failed their checksum. They were served as misses and the peer is marked suspect; "
            "the peer's memory or disk, or the peer itself, is suspect."
        ),
    ),
    Alert(
        name="KVPoolPeerReadsTimingOut",
        expr=(
            f"sum by (namespace, pool, node, peer) (rate({_PEER_TIMEOUTS}[10m]))\n"
            f"  / sum by (namespace, pool, node, peer) (rate({_PEER_READS}[10m]))\n"
            f"  > {PEER_TIMEOUTS_SHARE}\n"
            "and\n"
            f"sum by (namespace, pool, node, peer) (increase({_PEER_TIMEOUTS}[10m]))\n"
            f"  >= {PEER_TIMEOUTS_MIN}"
        ),
        for_="15m",
        severity="warning",
        summary="Reads from a kvpool peer keep timing out.",
        description=(
            "{{ $value | humanizePercentage }} of the chunk reads the agent of pool "
            "{{ $labels.pool }} on node {{ $labels.node }} made from its peer "
            "{{ $labels.peer }} in the last 10 minutes took longer than peers.timeout, for "
            f"15 minutes (alerting above {PEER_TIMEOUTS_SHARE:.0%}). Those chunks came "
            "from the shared tier or were computed again: the link to the peer is slower "
            "than the timeout allows, or the peer keeps stalling."
        ),
    ),
    Alert(
        name="KVPoolHandoffFailing",
        expr=(
            # Per result, as a share of every push the node sent: the result says what to
            # fix. Pushes to a node that is down (unreachable) are KVPoolPeerUnreachable's.
            f"sum by (namespace, pool, node, result) (rate({_FAILED_PUSHES}[10m]))\n"
            "  / ignoring (result) group_left\n"
            f"sum by (namespace, pool, node) (rate({_SENT_PUSHES}[10m]))\n"
            f"  > {HANDOFF_FAILING_SHARE}\n"
            "and\n"
            f"sum by (namespace, pool, node, result) (increase({_FAILED_PUSHES}[10m]))\n"
            f"  >= {HANDOFF_FAILING_MIN_PUSHES}"
        ),
        for_="15m",
        severity="warning",
        summary="kvpool hand-off pushes keep failing.",
        description=(
            "{{ $value | humanizePercentage }} of the hand-off pushes the agent of pool "
            "{{ $labels.pool }} on node {{ $labels.node }} sent in the last 10 minutes ended "
            f"{{{{ $labels.result }}}}, for 15 minutes (alerting above "
            f"{HANDOFF_FAILING_SHARE:.0%}). The puts are "
            "stored and the consumers read them by key, from a peer or the shared tier, "
            "instead of from their own DRAM."
        ),
    ),
    Alert(
        name="KVPoolPeerDeletesDropped",
        expr=(
            'increase(kvpool_peer_deletes_total{direction="sent", result="dropped"}[15m]) '
            "> 0"
        ),
        for_="1m",
        severity="warning",
        summary="kvpool DELETEs for a peer were dropped: it keeps deleted chunks.",
        description=(
            "{{ $value | humanize }} DELETEs the agent of pool {{ $labels.pool }} on node "
            "{{ $labels.node }} had for its peer {{ $labels.peer }} were dropped in the last "
            "15 minutes (more than 65,536 waited while the peer was unreachable, or it refused "
            "them for not following this agent yet and had not taken them 10 minutes later). "
            "The peer keeps those keys' copies and serves them until they are evicted."
        ),
    ),
    Alert(
        name="KVPoolPeerDirectoryFull",
        # Any refusal, kept up: a peer's reconnection can announce past the cap for a moment
        # (pending, then resolved); one that keeps refusing is at its cap while the pool
        # holds more, and loses cross-node hits until spec.peers.remoteChunks is raised.
        expr="increase(kvpool_peer_directory_full_total[10m]) > 0",
        for_="15m",
        severity="warning",
        summary="A kvpool peer directory is full: remote chunks are not listed.",
        description=(
            "The peer directory of the agent of pool {{ $labels.pool }} on node "
            "{{ $labels.node }} did not list {{ $value | humanize }} remote chunks its peers "
            "announced in the last 10 minutes, and has kept refusing them for 15 minutes: it "
            "holds peers.maxEntries (the pool's spec.peers.remoteChunks). LOOKUPs of those "
            "chunks go on to the shared tier, or miss, instead of reading them from the node "
            "that holds them."
        ),
    ),
    Alert(
        name="KVPoolHitRatioCollapse",
        expr=(
            f"{HIT_RATIO}\n"
            f"  < {HIT_RATIO_COLLAPSE_FACTOR} * avg_over_time({HIT_RATIO}[1h])\n"
            "and\n"
            f"{LOOKUP_KEYS} > {HIT_RATIO_MIN_KEYS_PER_SECOND}"
        ),
        for_="15m",
        severity="warning",
        summary="The kvpool hit ratio collapsed.",
        description=(
            "The block hit ratio of pool {{ $labels.pool }} in namespace "
            "{{ $labels.namespace }} is {{ $value | humanizePercentage }}, less than half of "
            "its own average over the past hour, for 15 minutes."
        ),
    ),
)

OPERATOR_ALERTS: tuple[Alert, ...] = (
    Alert(
        name="KVPoolOperatorReconcileErrors",
        expr=(
            "sum by (namespace, kind, reason) "
            "(rate(kvpool_operator_reconcile_errors_total[5m])) > 0"
        ),
        for_="15m",
        severity="warning",
        summary="The kvpool operator keeps failing to reconcile.",
        description=(
            "The kvpool operator in namespace {{ $labels.namespace }} has been failing to "
            "reconcile {{ $labels.kind }} resources ({{ $labels.reason }}) for 15 minutes."
        ),
    ),
)

ALERTS: tuple[Alert, ...] = AGENT_ALERTS + OPERATOR_ALERTS


def rule_groups() -> dict[str, Any]:
    """The rule file: `{"groups": [...]}` as Prometheus and the PrometheusRule spec take it."""
    return {
        "groups": [
            {
                "name": "kvpool.rules",
                "rules": [{"record": name, "expr": expr} for name, expr in RECORDING_RULES],
            },
            {"name": "kvpool-agent", "rules": [a.rule() for a in AGENT_ALERTS]},
            {"name": "kvpool-operator", "rules": [a.rule() for a in OPERATOR_ALERTS]},
        ]
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks, so expressions read as written."""


def _str_representer(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_representer)


def render() -> str:
    """The rule file text exactly as committed in the chart."""
    header = "# Generated by `python -m kvpool.operator.alerts`; do not edit.\n"
    body = yaml.dump(rule_groups(), Dumper=_Dumper, sort_keys=False, width=4096)
    return header + body


def main(argv: list[str] | None = None) -> int:
    """`python -m kvpool.operator.alerts [FILE]`: print the rule file, or write FILE."""
    return print_or_write(render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
