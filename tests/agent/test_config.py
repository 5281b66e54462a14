"""Config and policy files: unknown fields and bad values are named precisely."""

import re
from pathlib import Path

import pytest
import yaml

from kvpool.agent.config import (
    AgentConfig,
    ConfigError,
    expand_env,
    load_agent_config,
    load_policy,
)
from kvpool.agent.units import format_size, parse_duration, parse_size


@pytest.mark.parametrize(("text", "n"), [("512Mi", 512 << 20), ("1Gi", 1 << 30), ("10G", 10**10),
                                         ("1.5Ki", 1536), (4096, 4096)])
def test_sizes_parse_as_kubernetes_quantities(text: str | int, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "12Qi", "-1Mi", "0", "1.3", "Mi"])
def test_bad_sizes_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


def test_size_and_duration_round_trip() -> None:
    assert format_size(64 << 20) == "64Mi" and format_size(1000) == "1000"
    assert parse_duration("5m") == 300 and parse_duration("500ms") == 0.5


def test_unknown_field_is_named(tmp_path: Path) -> None:
    f = tmp_path / "agent.yaml"
    f.write_text("pool: p\ntiers:\n  dram:\n    size: 1Gi\n    colour: blue\n")
    with pytest.raises(ConfigError, match=r"tiers\.dram\.colour: unknown field"):
        load_agent_config(f)


def test_invalid_size_is_named(tmp_path: Path) -> None:
    f = tmp_path / "agent.yaml"
    f.write_text("maxChunkBytes: lots\n")
    with pytest.raises(ConfigError, match=r"maxChunkBytes: .*'lots' is not a size"):
        load_agent_config(f)


def test_watermarks_must_be_ordered(tmp_path: Path) -> None:
    f = tmp_path / "policy.yaml"
    f.write_text("tiers:\n  dram:\n    highWatermark: 0.5\n    lowWatermark: 0.7\n")
    with pytest.raises(ConfigError, match=r"tiers\.dram: .*lowWatermark \(0\.7\) must be below"):
        load_policy(f)


def test_a_stalled_clients_timeouts_default_to_ten_seconds_and_must_be_positive(
        tmp_path: Path) -> None:
    assert (AgentConfig().frame_timeout, AgentConfig().send_timeout) == (10.0, 10.0)
    f = tmp_path / "agent.yaml"
    f.write_text("frameTimeout: 3s\nsendTimeout: 500ms\n")
    assert (load_agent_config(f).frame_timeout, load_agent_config(f).send_timeout) == (3, 0.5)
    f.write_text("sendTimeout: 0s\n")
    with pytest.raises(ConfigError, match=r"sendTimeout: .*greater than zero"):
        load_agent_config(f)


def test_config_round_trips_through_its_wire_form() -> None:
    cfg = AgentConfig.model_validate({"pool": "ns.p", "tiers": {"dram": {"size": "2Gi"}}})
    again = AgentConfig.model_validate(cfg.to_wire())
    assert again == cfg and again.tiers.dram.size == 2 << 30


def test_arena_path_is_stable_per_socket() -> None:
    a = AgentConfig(socket_path=Path("/run/kvpool/a.sock"))
    assert a.arena_path() == AgentConfig(socket_path=Path("/run/kvpool/a.sock")).arena_path()
    assert a.arena_path() != AgentConfig(socket_path=Path("/run/kvpool/b.sock")).arena_path()


def _tenanted(tenants: str) -> AgentConfig:
    return AgentConfig.model_validate({
        "socketPath": "/run/kvpool/p/agent.sock",
        "tiers": {"dram": {"size": "1Gi", "path": "/var/lib/kvpool/dram/arena"},
                  "nvme": {"path": "/nvme", "size": "10Gi"},
                  "shared": {"url": "s3://bucket/pools/p/"}},
        "tenants": yaml.safe_load(tenants),
    })


def test_each_tenant_gets_its_own_socket_arena_nvme_directory_and_shared_prefix() -> None:
    cfg = _tenanted("[{name: a, dram: 256Mi}, {name: b}, {name: c, nvme: 4Gi}]")
    spaces = dict(cfg.spaces())
    assert list(spaces) == ["a", "b", "c"]
    a, b, c = spaces["a"], spaces["b"], spaces["c"]
    assert a.socket_path == Path("/run/kvpool/p/tenants/a/agent.sock")
    assert a.arena_path() == Path("/var/lib/kvpool/dram/tenants/a/arena")
    assert a.journal_path() == Path("/var/lib/kvpool/dram/tenants/a/arena.journal")
    assert a.tiers.nvme is not None and a.tiers.nvme.path == Path("/nvme/tenants/a")
    assert a.tiers.shared is not None and a.tiers.shared.url == "s3://bucket/pools/p/tenants/a"
    # Sized tenants get their size; the others share what is left equally, in whole pages.
    assert [s.tiers.dram.size for s in (a, b, c)] == [256 << 20, 384 << 20, 384 << 20]
    assert [s.tiers.nvme.size for s in (a, b, c) if s.tiers.nvme] == [3 << 30, 3 << 30, 4 << 30]
    assert all(s.tenants == [] for s in spaces.values())
    assert cfg.tiers.dram.size == 1 << 30  # the pool's own config is left as it was


def test_the_stores_record_is_kept_on_tmpfs_and_in_each_dir_that_outlives_a_reboot() -> None:
    """Beside the arena always; in the NVMe directory and the state directory where the
    agent has them; a tenant's under `tenants/<name>/` of each."""
    cfg = _tenanted("[{name: a}]").model_copy(update={"state_dir": Path("/var/lib/kvpool/st")})
    assert cfg.stores_paths() == [cfg.arena_path().with_suffix(".stores"),
                                  Path("/nvme/.kvpool-stores"),
                                  Path("/var/lib/kvpool/st/shared-stores.json")]
    [(_, a)] = cfg.spaces()
    assert a.state_dir == Path("/var/lib/kvpool/st/tenants/a")
    assert a.stores_paths()[1:] == [Path("/nvme/tenants/a/.kvpool-stores"),
                                    Path("/var/lib/kvpool/st/tenants/a/shared-stores.json")]
    assert AgentConfig().stores_paths() == [AgentConfig().arena_path().with_suffix(".stores")]


def test_an_arena_on_hugetlbfs_keeps_its_journal_lock_and_record_on_a_tmpfs() -> None:
    """hugetlbfs takes no write(2): the files that live as long as the arena go to
    `journalDir` (a tenant's under `tenants/<name>/`), by default /dev/shm named after the
    arena's path; on a tmpfs arena they stay beside it."""
    cfg = _tenanted("[{name: a}, {name: b}]")
    cfg.tiers.dram.huge_pages = True
    side = [cfg.journal_path(), cfg.lock_path(), cfg.stores_path()]
    assert [p.suffix for p in side] == [".journal", ".lock", ".stores"]
    assert all(p.parent == Path("/dev/shm") and p.stem.startswith("kvpool-arena-")
               for p in side)
    a, b = (space for _, space in cfg.spaces())
    assert a.journal_path() != b.journal_path() != cfg.journal_path()
    cfg.tiers.dram.journal_dir = Path("/var/lib/kvpool/journal")
    assert cfg.lock_path() == Path("/var/lib/kvpool/journal/arena.lock")
    a, _ = (space for _, space in cfg.spaces())
    assert a.journal_path() == Path("/var/lib/kvpool/journal/tenants/a/arena.journal")
    cfg.tiers.dram.journal_dir, cfg.tiers.dram.huge_pages = None, False
    assert cfg.lock_path() == cfg.arena_path().with_suffix(".lock")


def test_a_pool_without_tenants_is_one_space() -> None:
    cfg = AgentConfig()
    assert cfg.spaces() == [("", cfg)]


@pytest.mark.parametrize(("tenants", "error"), [
    ("[{name: a}, {name: a}]", "tenant 'a' is listed twice"),
    ("[{name: a, dram: 2Gi}]", "tenants ask for 2.0 GiB of dram, more than its 1.0 GiB"),
    ("[{name: a, dram: 1Gi}, {name: b}]", "tenants without a dram size get no dram"),
    ("[{name: a, nvme: 11Gi}]", "tenants ask for 11.0 GiB of nvme, more than"),
    ("[{name: ../a}]", "tenants.0.name: String should match pattern"),
])
def test_bad_tenants_are_named(tmp_path: Path, tenants: str, error: str) -> None:
    f = tmp_path / "agent.yaml"
    f.write_text(yaml.safe_dump({"tiers": {"nvme": {"path": "/nvme", "size": "10Gi"}},
                                 "tenants": yaml.safe_load(tenants)}))
    with pytest.raises(ConfigError, match=re.escape(error)):
        load_agent_config(f)


def test_tenant_nvme_size_needs_an_nvme_tier() -> None:
    with pytest.raises(ValueError, match="a tenant has an nvme size but the pool has no NVMe"):
        AgentConfig.model_validate({"tenants": [{"name": "a", "nvme": "1Gi"}]})


def test_peers_are_off_by_default_and_need_the_pools_secret_when_on(tmp_path: Path) -> None:
    assert AgentConfig().peers.enabled is False
    f = tmp_path / "agent.yaml"
    f.write_text("peers:\n  enabled: true\n")
    with pytest.raises(ConfigError, match=r"peers: .*secretFile is required"):
        load_agent_config(f)
    f.write_text("peers:\n  enabled: true\n  secretFile: /etc/kvpool/peers/secret\n"
                 "  addresses: ['10.0.0.2:9410', '[fd00::3]:9410']\n  timeout: 100ms\n"
                 "  discovery: kvpool-p-peers.ns.svc\n"
                 "  tls: {certFile: /t/tls.crt, keyFile: /t/tls.key, caFile: /t/ca.crt}\n")
    cfg = load_agent_config(f)
    assert cfg.peers.port == 9410 and cfg.peers.timeout == 0.1 and cfg.peers.connections == 4
    assert cfg.peers.tls is not None and cfg.peers.tls.ca_file == Path("/t/ca.crt")
    assert AgentConfig.model_validate(cfg.to_wire()) == cfg


@pytest.mark.parametrize(("peers", "error"), [
    ("{port: 80}", r"peers\.port: .*greater than or equal to 1024"),
    ("{addresses: ['nohost']}", r"peers\.addresses: .*addresses\[0\]: 'nohost' is not host:port"),
    ("{connections: 0}", r"peers\.connections: "),
    ("{timeout: 0s}", r"peers\.timeout: .*greater than zero"),
    ("{tls: {certFile: /a}}", r"peers\.tls\.keyFile: Field required"),
])
def test_bad_peers_settings_are_named(tmp_path: Path, peers: str, error: str) -> None:
    f = tmp_path / "agent.yaml"
    f.write_text(f"peers: {peers}\n")
    with pytest.raises(ConfigError, match=error):
        load_agent_config(f)


def test_an_advertised_address_expands_the_agents_environment_as_kubernetes_does() -> None:
    env = {"POD_IP": "10.1.2.3"}
    assert expand_env("$(POD_IP)", env) == "10.1.2.3"
    assert expand_env("[$(POD_IP)]", env) == "[10.1.2.3]"
    assert expand_env("$(MISSING)", env) == "$(MISSING)"  # left as written, as Kubernetes
    assert expand_env("10.0.0.9", env) == "10.0.0.9"
