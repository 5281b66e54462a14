"""The peer tier's metrics (docs/metrics.md, "Peer tier"), in the agent's registry."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

READ_RESULTS = ("ok", "absent", "error", "timeout", "corrupt")
"""How a read from a peer ended: served, not held there (a stale entry), a failed
connection or protocol, past `peers.timeout`, bytes that failed their checksum."""
SERVE_RESULTS = ("ok", "absent", "error")
PUSH_RESULTS = ("ok", "held", "refused", "error", "timeout", "auth", "unreachable", "unknown",
                "dropped")
"""How a hand-off push ended. Sent: stored and pinned there, held there already, refused
by the receiver (its pin quota, its spaces), its read failed, past the push's time, the
peer did not prove the pool's secret, the node is down, no peer has the hinted name, the
push queue was full. Received: the first four."""
HANDOFF_ENDS = ("read", "expired", "deleted")
DELETE_RESULTS = ("ok", "absent", "refused", "error", "dropped")
"""How a DELETE sent to a peer (a client's DELETE reaching the pool's other copies) ended:
deleted there, not held there, refused (no such tenant space there, or it does not follow
this agent), not delivered yet (the peer unreachable: tried again when it is back),
dropped (too many waiting for it). Received: the first three."""
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class PeerMetrics:
    def __init__(self, registry: CollectorRegistry, pool: str) -> None:
        r, p = registry, ["pool"]
        self.pool = pool
        self._bytes = Counter("kvpool_peer_bytes", "Chunk bytes moved between this agent and "
                              "a peer, by direction (read: from it, served: to it)",
                              [*p, "peer", "direction"], registry=r)
        self._requests = Counter("kvpool_peer_requests", "Chunk reads between this agent and "
                                 "a peer, by direction and result",
                                 [*p, "peer", "direction", "result"], registry=r)
        self._latency = Histogram("kvpool_peer_request_duration_seconds",
                                  "Chunk reads between this agent and a peer, by direction",
                                  [*p, "peer", "direction"], buckets=_BUCKETS, registry=r)
        self.auth_failures = Counter(
            "kvpool_peer_auth_failures", "Peer connections refused or dropped because a side "
            "did not prove the pool's secret", p, registry=r).labels(pool)
        self.protocol_errors = Counter(
            "kvpool_peer_protocol_errors", "Peer connections closed for a frame that breaks "
            "the peer protocol", p, registry=r).labels(pool)
        self.resyncs = Counter(
            "kvpool_peer_directory_resyncs", "Inventories received from peers (each drops "
            "what the directory had of that peer first)", [*p, "peer"], registry=r)
        self.suspect = Counter(
            "kvpool_peer_suspect", "Times a peer was marked suspect (it served bytes that "
            "failed their checksum): not read from for a while", [*p, "peer"], registry=r)

        self._pushes = Counter(
            "kvpool_peer_pushes", "Hand-off pushes (a put hinted with the node that will read "
            "it) between this agent and a peer, by direction (sent, received) and result",
            [*p, "peer", "direction", "result"], registry=r)
        self._push_latency = Histogram(
            "kvpool_peer_push_duration_seconds", "Hand-off pushes sent, from the offer (its "
            "batch's write) to the receiver's answer (its read of the chunk included)",
            [*p, "peer"], buckets=_BUCKETS, registry=r)
        self._deletes = Counter(
            "kvpool_peer_deletes", "DELETEs of a key between this agent and a peer (a "
            "client's DELETE reaching the copies other agents hold), by direction (sent, "
            "received) and result", [*p, "peer", "direction", "result"], registry=r)
        self._link_rate = Gauge(
            "kvpool_peer_link_bytes_per_second", "What batches of chunk reads from a peer "
            "delivered, averaged over the last batches: it sizes the batches so that each "
            "lands within peers.timeout", [*p, "peer"], registry=r)
        self._reloads = Counter(
            "kvpool_peer_credential_reloads", "Changes of the pool secret's or the TLS files "
            "taken (ok) or refused because they do not load (error: the ones in use stay)",
            [*p, "what", "result"], registry=r)
        self._cert_expiry = Gauge(
            "kvpool_peer_tls_certificate_expiry_timestamp_seconds", "When the TLS certificate "
            "this agent shows its peers (peers.tls) expires, as Unix time: the one in use, "
            "read again as its file changes", p, registry=r)
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        """The labelled series a read or a serve counts into, by (peer, direction, result),
        looked up once: `labels` takes a lock and builds its key at each call, which was a
        tenth of the reading agent's Python time per chunk."""
        self._moved: dict[tuple[str, str], Any] = {}
        """Its bytes' series, by (peer, direction): made at the first bytes moved."""
        self._handoffs = Counter(
            "kvpool_peer_handoff_pins", "Pins of chunks pushed here that ended, by how: read "
            "(the first GET or ACQUIRE), expired (peers.handoffTtl), deleted", [*p, "end"],
            registry=r)

    def reloaded(self, what: str, result: str) -> None:
        """A change of the peer credentials' files: `what` secret or tls, `result` ok or
        error."""
        self._reloads.labels(self.pool, what, result).inc()

    def certificate_expires(self, at: float) -> None:
        """The certificate in use (`peers.tls`) expires at Unix time `at`."""
        self._cert_expiry.labels(self.pool).set(at)

    def deleted(self, peer: str, direction: str, result: str) -> None:
        self._deletes.labels(self.pool, peer, direction, result).inc()

    def pushed(self, peer: str, result: str, seconds: float) -> None:
        self._pushes.labels(self.pool, peer, "sent", result).inc()
        if result in ("ok", "held", "refused", "error"):  # answered (or failed) by the peer
            self._push_latency.labels(self.pool, peer).observe(seconds)

    def received(self, peer: str, result: str) -> None:
        self._pushes.labels(self.pool, peer, "received", result).inc()

    def handoff_ended(self, end: str) -> None:
        self._handoffs.labels(self.pool, end).inc()

    def link_rate(self, peer: str, bytes_per_second: float) -> None:
        self._link_rate.labels(self.pool, peer).set(bytes_per_second)

    def read(self, peer: str, result: str, seconds: float, nbytes: int = 0) -> None:
        self._count(peer, "read", result, seconds, nbytes)

    def served(self, peer: str, result: str, seconds: float, nbytes: int = 0) -> None:
        self._count(peer, "served", result, seconds, nbytes)

    def _count(self, peer: str, direction: str, result: str, seconds: float,
               nbytes: int) -> None:
        at = (peer, direction, result)
        series = self._children.get(at)
        if series is None:
            series = self._children[at] = (
                self._requests.labels(self.pool, peer, direction, result),
                self._latency.labels(self.pool, peer, direction))
        requests, latency = series
        requests.inc()
        latency.observe(seconds)
        if nbytes:
            moved = self._moved.get((peer, direction))
            if moved is None:
                moved = self._bytes.labels(self.pool, peer, direction)
                self._moved[peer, direction] = moved
            moved.inc(nbytes)
