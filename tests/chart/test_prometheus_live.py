"""Every dashboard query and every alert against a real Prometheus scraping a real agent.

The test starts, on 127.0.0.1 only:
- two real `kvpool agent` processes of one pool, peers of each other (the peer tier on
  loopback, over TLS, the second standing for another node), and drives load through
  `KVPoolClient`,
  part of it reading on the first agent chunks put on the second, and every other put
  hinted with the other node (a hand-off) and read there;
- the operator's real metrics registry (`kvpool.operator.metrics`) served by a child
  process, standing in for the operator process, which needs a Kubernetes API server;
- the real `prometheus` binary, scraping both every second with the labels the chart's
  PodMonitor adds (`job="kvpool-agent"`, `namespace`, `node`, `pod`) and loading the
  chart's rule file.
Then it evaluates each panel query (template variables substituted) and each alert and
recording rule through the HTTP API.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.agent.client import KVPoolClient
from kvpool.agent.constants import AGENT_JOB
from kvpool.bench.certs import make_ca
from kvpool.bench.local import LocalAgent, free_port
from kvpool.operator import alerts, dashboard

from .conftest import CHART

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus (Debian package prometheus) is not installed"
)

NAMESPACE = "kvpool-test"
POOL = f"{NAMESPACE}.cache"
NODE = "node-a"
PEER_NODE = "node-b"
RATE_INTERVAL = "15s"
"""What Grafana would give `$__rate_interval` for a 1 s scrape interval and short ranges."""
VARIABLES = {
    "$__rate_interval": RATE_INTERVAL,
    "$namespace": NAMESPACE,
    "$pool": POOL,
}


CHUNK = 256 * 1024
CHUNK_TOKENS = 16
"""Tokens per chunk the load's client announces at HELLO: the agent counts prefill tokens."""
LOAD_SECONDS = 120.0
"""Upper bound of the load thread's life; it stops earlier when the module's tests end."""
MAX_ENTRIES = 10_000
"""The agent's peer directory cap (`peers.maxEntries`): room for every chunk its peer holds."""
PEER_MAX_ENTRIES = 8
"""The peer agent's: fewer than the agent's DRAM and NVMe hold, so its directory fills and
refuses the agent's chunks under the load (the "Peer directory full" panel, on its node)."""


def substitute(expr: str, node: str = NODE) -> str:
    """`expr` as Grafana sends it, the dashboard's variables set to this test's pool and
    `node` (the agent's, unless another is asked for)."""
    expr = expr.replace("$node", node)
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


# ----------------------------------------------------------------------------- processes


def _wait(cond: Any, timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = cond()
        except OSError:
            last = None
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body: bytes = r.read()
        return body


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


OPERATOR_METRICS_SCRIPT = """
import sys, time
from kvpool.operator import metrics
metrics.serve(int(sys.argv[1]), addr="127.0.0.1")
metrics.succeeded("KVCachePool")
while True:
    time.sleep(3600)
"""


@dataclass(frozen=True)
class Peers:
    """The two agents' peer ports, the pool's secret file and its TLS files."""

    port: int
    peer_port: int
    secret: Path
    tls: dict[str, str]

    def config(self, port: int, other: int, max_entries: int) -> dict[str, Any]:
        """An agent's peers, named by address (the hand-off's hints name nodes: each
        agent's config gives its own `nodeName`), its directory capped at `max_entries`;
        TLS between them (the certificate's expiry has its panel)."""
        return {
            "enabled": True, "port": port, "address": "127.0.0.1", "advertise": "127.0.0.1",
            "secretFile": str(self.secret), "addresses": [f"127.0.0.1:{other}"],
            "maxEntries": max_entries, "tls": self.tls,
        }


@pytest.fixture(scope="module")
def peers(tmp_path_factory: pytest.TempPathFactory) -> Peers:
    directory = tmp_path_factory.mktemp("peers")
    secret = directory / "secret"
    secret.write_text(os.urandom(32).hex())
    return Peers(free_port(), free_port(), secret, make_ca(directory / "ca", "pool CA"))


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory, peers: Peers) -> Iterator[LocalAgent]:
    workdir = tmp_path_factory.mktemp("agent")
    (workdir / "nvme").mkdir()
    (workdir / "shared").mkdir()
    # KV events on (topic node: the load's client names no engine pod), so the events
    # panels show events published under load; the peer tier on, with the other agent.
    config = workdir / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "events": {
            "enabled": True, "port": free_port(), "replayPort": free_port(), "topic": "node"},
        "peers": peers.config(peers.port, peers.peer_port, MAX_ENTRIES),
        "nodeName": NODE,
    }))
    args = ["--config", str(config), "--no-lock", "--pool", POOL,
            "--nvme-dir", str(workdir / "nvme"), "--nvme", "64Mi",
            "--shared", (workdir / "shared").as_uri()]
    with LocalAgent(*args, workdir=workdir, dram="16Mi") as a:
        yield a


@pytest.fixture(scope="module")
def peer_agent(tmp_path_factory: pytest.TempPathFactory, peers: Peers) -> Iterator[LocalAgent]:
    """The pool's agent on another node (here: another peer port on loopback)."""
    workdir = tmp_path_factory.mktemp("peer-agent")
    config = workdir / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "peers": peers.config(peers.peer_port, peers.port, PEER_MAX_ENTRIES),
        "nodeName": PEER_NODE}))
    with LocalAgent("--config", str(config), "--no-lock", "--pool", POOL, workdir=workdir,
                    dram="16Mi") as a:
        yield a


@pytest.fixture(scope="module")
def operator_metrics_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    log = (tmp_path_factory.mktemp("operator") / "metrics.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", OPERATOR_METRICS_SCRIPT, str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        _wait(lambda: _get(f"http://127.0.0.1:{port}/metrics"), 30, "operator metrics")
        yield port
    finally:
        _stop(proc)
        log.close()


@dataclass
class Prometheus:
    url: str

    def query(self, expr: str) -> list[dict[str, Any]]:
        params = urllib.parse.urlencode({"query": expr})
        body = json.loads(_get(f"{self.url}/api/v1/query?{params}"))
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def api(self, path: str) -> Any:
        body = json.loads(_get(f"{self.url}/api/v1/{path}"))
        assert body["status"] == "success", body
        return body["data"]


@pytest.fixture(scope="module")
def prometheus(
    tmp_path_factory: pytest.TempPathFactory,
    agent: LocalAgent,
    peer_agent: LocalAgent,
    operator_metrics_port: int,
) -> Iterator[Prometheus]:
    assert PROMETHEUS is not None
    home = tmp_path_factory.mktemp("prometheus")
    rules = home / "kvpool-rules.yaml"
    shutil.copy(CHART / "files" / "kvpool-rules.yaml", rules)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {
                # What the chart's PodMonitor produces for an agent pod.
                "job_name": AGENT_JOB,
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{agent.metrics_port}"],
                        "labels": {"namespace": NAMESPACE, "node": NODE, "pod": "kvpool-a"},
                    },
                    {
                        "targets": [f"127.0.0.1:{peer_agent.metrics_port}"],
                        "labels": {"namespace": NAMESPACE, "node": PEER_NODE, "pod": "kvpool-b"},
                    },
                ],
            },
            {
                # What the chart's ServiceMonitor produces for the operator.
                "job_name": "kvpool-operator",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{operator_metrics_port}"],
                        "labels": {"namespace": "kvpool", "pod": "kvpool-operator"},
                    }
                ],
            },
        ],
    }
    (home / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (home / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=home,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: proc.poll() is None and _get(f"{url}/-/ready"), 60, "prometheus ready")
        yield Prometheus(url)
    finally:
        _stop(proc)
        log.close()


class Load:
    """Clients putting, looking up and reading chunks in a bounded background loop; chunks
    put on the peer agent are looked up and read on the agent a few rounds later (through
    the peer tier, once the peer's inventory reached it). Every other put on each agent is
    hinted with the other's node (a hand-off: pushed there, pinned) and read there a few
    rounds later, ending its pin. Now and then one of them DELETEs a chunk the agent read
    from the peer (the other is sent the DELETE, and takes it)."""

    def __init__(self, socket_path: Path, peer_socket_path: Path) -> None:
        self.socket_path = socket_path
        self.peer_socket_path = peer_socket_path
        self.stop = threading.Event()
        self.lookups = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kvpool-load", daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + LOAD_SECONDS
        data = os.urandom(CHUNK)
        try:
            with (
                KVPoolClient(self.socket_path, chunk_tokens=CHUNK_TOKENS) as c,
                KVPoolClient(self.peer_socket_path, chunk_tokens=CHUNK_TOKENS) as peer,
            ):
                keys: list[bytes] = []
                on_peer: list[bytes] = []
                while not self.stop.is_set() and time.monotonic() < deadline:
                    # Extend a prefix by a chunk, look the prefix up (hits) plus a fresh key
                    # (a miss), read a chunk back. 16 MiB of DRAM fill after ~64 chunks, so
                    # evictions follow (demotions into NVMe when the agent has it); looking
                    # up and reading chunks from ~100 puts ago then hits the slower tiers.
                    handoff = self.lookups % 2 == 0
                    key = os.urandom(16)
                    c.put(key, data, to=PEER_NODE if handoff else None)
                    keys.append(key)
                    c.lookup([*keys[-32:], os.urandom(16)])
                    c.get(keys[-32:][0])
                    old = keys[max(0, len(keys) - 100) : max(1, len(keys) - 96)]
                    c.lookup(old)
                    c.get(old[0])
                    on_peer.append(os.urandom(16))
                    peer.put(on_peer[-1], data, to=NODE if handoff else None)
                    if len(on_peer) > 5:  # pushed here (a DRAM hit) or read from the peer
                        c.lookup([on_peer[-6]])
                        c.get(on_peer[-6])
                        if handoff:  # the consumer's read on the peer, six rounds later
                            peer.get(keys[-7])
                        elif self.lookups % 10 == 1:  # gone from the pool: the peer too
                            c.delete(on_peer[-6])
                        elif self.lookups % 10 == 3:  # and the other way round
                            peer.delete(on_peer[-6])
                    self.lookups += 1
                    time.sleep(0.01)
        except BaseException as e:
            self.error = e

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def loaded(
    prometheus: Prometheus, agent: LocalAgent, peer_agent: LocalAgent
) -> Iterator[Prometheus]:
    """Prometheus once it has scraped the agent under load for a rate interval, reads
    from its peer included."""
    with Load(agent.socket_path, peer_agent.socket_path) as load:
        _wait(lambda: load.lookups >= 50 or load.error, 60, "load to start")
        assert load.error is None, load.error

        def lookups_in_window() -> bool:
            # the load's agent only: the peer agent's series (no lookups) may come first
            expr = (f'sum(increase(kvpool_lookups_total{{pool="{POOL}", node="{NODE}"}}'
                    f'[{RATE_INTERVAL}]))')
            result = prometheus.query(expr)
            return bool(result) and float(result[0]["value"][1]) > 0

        def peer_reads_in_window() -> bool:
            expr = (f'sum(increase(kvpool_peer_requests_total{{pool="{POOL}", node="{NODE}", '
                    f'direction="read", result="ok"}}[{RATE_INTERVAL}]))')
            result = prometheus.query(expr)
            return bool(result) and float(result[0]["value"][1]) > 0

        # A rate needs two samples inside its window; the rules evaluate every second.
        _wait(lookups_in_window, 60, "prometheus to see lookups within a rate interval")
        _wait(peer_reads_in_window, 60, "prometheus to see reads from the peer")
        yield prometheus
        assert load.error is None, load.error


# ----------------------------------------------------------------------------- panels


def _panel_cases() -> list[Any]:
    return [pytest.param(expr, id=f"{title}: {expr[:60]}")
            for title, expr in dashboard.panel_queries()]


@pytest.mark.parametrize("expr", _panel_cases())
def test_dashboard_query_returns_series(loaded: Prometheus, expr: str) -> None:
    result = _wait(lambda: loaded.query(substitute(expr)), 5, f"data for {expr}")
    assert len(result) >= 1


def test_every_panel_query_is_checked() -> None:
    assert len(dashboard.panel_queries()) >= 25


def test_load_shows_as_hits_traffic_and_latency(loaded: Prometheus) -> None:
    """The queries do not only return series: under load they return the load."""

    def value(expr: str) -> float:
        (sample,) = loaded.query(substitute(expr))
        return float(sample["value"][1])

    by_title = {title: expr for title, expr in dashboard.panel_queries()}
    hit_ratio = value(by_title["Block hit ratio (overall)"])
    assert 0 < hit_ratio < 1
    dram = f'{dashboard.SEL}, tier="dram"'
    written = substitute(f"sum(rate(kvpool_tier_written_bytes_total{{{dram}}}[{RATE_INTERVAL}]))")
    assert value(written) > 0
    p99 = substitute(
        "histogram_quantile(0.99, sum by (le) (rate(kvpool_op_duration_seconds_bucket"
        f'{{{dashboard.SEL}, op="lookup"}}[{RATE_INTERVAL}])))'
    )
    assert 0 < value(p99) < 10
    up = value(by_title["Agent up per node"])
    assert up == 1
    # DRAM overflows into NVMe after ~64 puts; every put is written through to the shared
    # tier. Wait (bounded) until the load got there.
    for tier, counter in (("nvme", "kvpool_tier_written_bytes_total"),
                          ("nvme", "kvpool_tier_hits_total"),
                          ("shared", "kvpool_tier_written_bytes_total")):
        expr = substitute(
            f'sum(rate({counter}{{{dashboard.SEL}, tier="{tier}"}}[{RATE_INTERVAL}]))')
        _wait(lambda e=expr: value(e) > 0, 45, f"{counter} of the {tier} tier to rise")
    shared_up = substitute(f'kvpool_tier_healthy{{{dashboard.SEL}, tier="shared"}}')
    assert value(shared_up) == 1


def test_load_shows_tokens_served_and_events_published(loaded: Prometheus) -> None:
    """The value and events panels under load: prefill tokens served from DRAM, a token hit
    ratio between the all-hit and all-miss ends, events published and none dropped."""
    by_title: dict[str, list[str]] = {}
    for title, expr in dashboard.panel_queries():
        by_title.setdefault(title, []).append(expr)

    def samples(expr: str) -> dict[str, float]:
        return {
            str(s["metric"].get("tier", "")): float(s["value"][1])
            for s in loaded.query(substitute(expr))
        }

    def total(expr: str) -> float:
        return sum(samples(expr).values())  # NaN (0/0) stays NaN: compares false

    served, missed = by_title["Tokens served from the pool"]
    _wait(lambda: samples(served).get("dram", 0) > 0, 45, "tokens served from DRAM")
    _wait(lambda: total(missed) > 0, 45, "missed tokens")
    (ratio,) = by_title["Token hit ratio"]
    _wait(lambda: 0 < total(ratio) < 1, 45, "a token hit ratio")
    (published,) = by_title["KV events per second"]
    _wait(lambda: total(published) > 0, 45, "KV events published")
    (dropped,) = by_title["KV events dropped"]
    assert samples(dropped) == {"": 0.0}


def test_load_shows_reads_from_the_peer(loaded: Prometheus) -> None:
    """The peer tier's panels under load: the agent reads chunks from its peer (bytes, ok
    reads, a latency), follows it, knows its chunks within its directory's room (none
    refused), and none failed their checksum or its secret; the DELETEs made on either
    reach the other, which takes them."""
    by_title: dict[str, list[str]] = {}
    for title, expr in dashboard.panel_queries():
        by_title.setdefault(title, []).append(expr)

    def samples(expr: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in loaded.query(substitute(expr)):
            key = str(s["metric"].get(label, ""))
            out[key] = out.get(key, 0.0) + float(s["value"][1])
        return out

    (moved,) = by_title["Peer bytes per second"]
    _wait(lambda: samples(moved, "direction").get("read", 0) > 0, 45, "bytes read from the peer")
    (reads,) = by_title["Peer reads by result"]
    _wait(lambda: samples(reads, "result").get("ok", 0) > 0, 45, "reads from the peer")
    assert samples(reads, "result").get("corrupt", 0) == 0
    p50, _ = by_title["Peer read latency p50 / p99"]
    _wait(lambda: 0 < samples(p50, "direction").get("read", 0) < 10, 45, "a peer read latency")
    (followed,) = by_title["Peers followed"]
    assert [s["value"][1] for s in loaded.query(substitute(followed))] == ["1"]
    (entries,) = by_title["Peer directory"]
    assert sum(samples(entries, "node").values()) > 0
    (use,) = by_title["Peer directory use"]
    assert 0 < samples(use, "node")[NODE] < 1
    (full,) = by_title["Peer directory full"]
    assert samples(full, "node") == {NODE: 0.0}
    refused, broken = by_title["Peer connections refused"]
    assert sum(samples(refused, "node").values()) == 0
    assert sum(samples(broken, "node").values()) == 0
    (deletes,) = by_title["Peer DELETEs by result"]

    def taken(direction: str) -> float:  # DELETEs the receiving side took (held or not)
        return sum(float(s["value"][1]) for s in loaded.query(substitute(deletes))
                   if s["metric"]["direction"] == direction
                   and s["metric"]["result"] in ("ok", "absent"))

    # The agent's DELETEs sent to the peer, and the peer's it took. (A DELETE made before
    # the receiver follows the sender, as the two start, is refused: not what is checked.)
    for direction in ("sent", "received"):
        _wait(lambda d=direction: taken(d) > 0, 45, f"peer DELETEs {direction} and taken")
    assert samples(deletes, "result").get("dropped", 0) == 0
    # A series per peer followed, with its node's name, of the DELETEs held for it.
    (waiting,) = by_title["Peer DELETEs waiting"]
    assert set(samples(waiting, "peer")) == set(samples(followed, "peer")) != set()
    assert "" not in samples(waiting, "peer_node")


def test_load_shows_handoffs_pushed_pinned_and_read(loaded: Prometheus) -> None:
    """The hand-off's panels under load, on the agent: it sends pushes to its peer's node
    and receives the peer's (ok), with a push latency; the pushed chunks' pins end by the
    reads on this node; the pinned bytes are a gauge within the pin quota."""
    by_title: dict[str, list[str]] = {}
    for title, expr in dashboard.panel_queries():
        by_title.setdefault(title, []).append(expr)

    def samples(expr: str, *labels: str) -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {}
        for s in loaded.query(substitute(expr)):
            key = tuple(str(s["metric"].get(label, "")) for label in labels)
            out[key] = out.get(key, 0.0) + float(s["value"][1])
        return out

    (pushes,) = by_title["Hand-off pushes by result"]
    for direction in ("sent", "received"):
        _wait(lambda d=direction: samples(pushes, "direction", "result").get((d, "ok"), 0) > 0,
              45, f"hand-off pushes {direction}")
    p50, p99 = by_title["Hand-off push latency p50 / p99"]
    _wait(lambda: 0 < samples(p50, "node").get((NODE,), 0) < 10, 45, "a push latency")
    assert samples(p50, "node")[(NODE,)] <= samples(p99, "node")[(NODE,)]
    (ended,) = by_title["Hand-off pins ended"]
    _wait(lambda: samples(ended, "end").get(("read",), 0) > 0, 45, "pins ended by a read")
    (pinned,) = by_title["Hand-off pinned bytes"]
    (value,) = samples(pinned, "node").values()
    # at most peers.handoffShare (25 %) of the 16 MiB arena
    assert 0 <= value <= 4 << 20


def test_a_full_directory_shows_as_used_up_and_refusing(loaded: Prometheus) -> None:
    """The directory panels on the peer agent's node, whose directory holds fewer than the
    agent's tiers: it is used up to its cap, and refuses the agent's chunks as they come."""
    by_title = {title: expr for title, expr in dashboard.panel_queries()}

    def value(title: str) -> float | None:
        """The panel's one series on the peer node; None before Prometheus has it (a rate
        needs two scrapes of the peer agent in its window)."""
        result = loaded.query(substitute(by_title[title], node=PEER_NODE))
        assert [s["metric"]["node"] for s in result] in ([], [PEER_NODE])
        return float(result[0]["value"][1]) if result else None

    _wait(lambda: (value("Peer directory full") or 0) > 0, 45,
          "chunks refused by the full directory")
    _wait(lambda: value("Peer directory use") == 1, 45, "the directory used up")
    entries = value("Peer directory")
    assert entries is not None and entries <= PEER_MAX_ENTRIES  # never past its cap


# ----------------------------------------------------------------------------- alerts


def test_every_alert_expression_is_a_valid_query(loaded: Prometheus) -> None:
    for alert in alerts.ALERTS:
        loaded.query(alert.expr)  # raises on a query error


def test_recording_rules_produce_the_pool_hit_ratio(loaded: Prometheus) -> None:
    for name, _ in alerts.RECORDING_RULES:
        result = _wait(lambda n=name: loaded.query(f'{n}{{pool="{POOL}"}}'), 30, name)
        assert result[0]["metric"]["namespace"] == NAMESPACE


def test_prometheus_loaded_and_evaluates_every_rule_without_error(loaded: Prometheus) -> None:
    def evaluated() -> list[dict[str, Any]] | None:
        groups = loaded.api("rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        never = [r for r in rules if r.get("lastEvaluation", "0001").startswith("0001")]
        return rules if rules and not never else None

    rules = _wait(evaluated, 30, "every rule evaluated")
    names = {r["name"] for r in rules}
    assert names == {a.name for a in alerts.ALERTS} | {n for n, _ in alerts.RECORDING_RULES}
    unhealthy = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert unhealthy == {}
