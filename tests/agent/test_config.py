"""Config and policy files: unknown fields and bad values are named precisely."""

from pathlib import Path

import pytest

from kvpool.agent.config import AgentConfig, ConfigError, load_agent_config, load_policy
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


def test_config_round_trips_through_its_wire_form() -> None:
    cfg = AgentConfig.model_validate({"pool": "ns.p", "tiers": {"dram": {"size": "2Gi"}}})
    again = AgentConfig.model_validate(cfg.to_wire())
    assert again == cfg and again.tiers.dram.size == 2 << 30


def test_arena_path_is_stable_per_socket() -> None:
    a = AgentConfig(socket_path=Path("/run/kvpool/a.sock"))
    assert a.arena_path() == AgentConfig(socket_path=Path("/run/kvpool/a.sock")).arena_path()
    assert a.arena_path() != AgentConfig(socket_path=Path("/run/kvpool/b.sock")).arena_path()
