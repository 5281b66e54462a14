"""What the vLLM connector reads from vLLM's config and the pod's environment (no vLLM: the
config objects below carry the attributes vLLM 0.32's have, as the connector reads them)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.agent.integrations.vllm.layout import ChunkTokensError
from kvpool.agent.integrations.vllm.settings import UnsupportedModel, settings


class FullAttentionSpec(SimpleNamespace):
    """Named as vLLM's: the connector accepts this spec class only."""


class SlidingWindowSpec(SimpleNamespace):
    pass


class Transfer(SimpleNamespace):
    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)


def config(role: str = "kv_both", extra: dict[str, Any] | None = None, block_size: int = 32,
           spec: Any = None, cache_dtype: str = "auto") -> tuple[Any, Any]:
    spec = spec or FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128,
                                     head_size_v=128, dtype="torch.bfloat16",
                                     sliding_window=None)
    transfer = Transfer(kv_connector_extra_config=extra or {}, kv_role=role,
                        is_kv_producer=role in ("kv_producer", "kv_both"),
                        is_kv_consumer=role in ("kv_consumer", "kv_both"))
    vllm_config = SimpleNamespace(
        kv_transfer_config=transfer, cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        model_config=SimpleNamespace(model="org/model", get_total_num_hidden_layers=lambda: 32),
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1))
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    return vllm_config, kv_cache_config


@pytest.mark.parametrize(("role", "loads", "saves"), [
    ("kv_both", True, True), ("kv_consumer", True, False), ("kv_producer", False, True)])
def test_roles_are_vllms_a_consumer_only_loads_a_producer_only_stores(
        role: str, loads: bool, saves: bool) -> None:
    s = settings(*config(role))
    assert (s.loads, s.saves) == (loads, saves)


@pytest.mark.parametrize(("role", "wait"), [
    ("kv_both", 0.05), ("kv_producer", 0.05), ("kv_consumer", 0.5)])
def test_a_decode_engine_waits_longer_for_a_lookup_the_index_cannot_answer(
        role: str, wait: float) -> None:
    assert settings(*config(role)).lookup_wait == wait
    assert settings(*config(role, extra={"lookup_wait": 2})).lookup_wait == 2


def test_loads_read_without_a_lease_unless_the_environment_or_the_config_says_no(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_LEASE_FREE", raising=False)
    assert settings(*config()).lease_free is True
    monkeypatch.setenv("KVPOOL_LEASE_FREE", "0")
    assert settings(*config()).lease_free is False
    assert settings(*config(extra={"lease_free": True})).lease_free is True
    monkeypatch.setenv("KVPOOL_LEASE_FREE", "yes")
    assert settings(*config(extra={"lease_free": "false"})).lease_free is False


def test_the_pods_environment_names_socket_tenant_and_chunk_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_SOCKET", "/run/kvpool/p/agent.sock")
    monkeypatch.setenv("KVPOOL_TENANT", "team-a")
    monkeypatch.setenv("KVPOOL_CHUNK_TOKENS", "128")
    s = settings(*config())
    assert s.socket == "/run/kvpool/p/agent.sock"
    assert (s.layout.tenant, s.layout.chunk_tokens, s.layout.blocks_per_chunk) == ("team-a",
                                                                                   128, 4)
    assert (s.layout.model, s.layout.dtype, s.layout.layers, s.layout.kv_heads,
            s.layout.tp_size) == ("org/model", "bfloat16", 32, 8, 2)
    # kv_connector_extra_config wins over the environment
    s = settings(*config(extra={"chunk_tokens": 64, "model": "llama-8b", "tenant": "t"}))
    assert (s.layout.chunk_tokens, s.layout.model, s.layout.tenant) == (64, "llama-8b", "t")


def test_a_quantised_kv_cache_is_another_dtype_in_the_keys() -> None:
    assert settings(*config(cache_dtype="fp8_e4m3")).layout.dtype == "bfloat16/fp8_e4m3"


def test_a_chunk_size_that_is_not_whole_blocks_stops_the_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_CHUNK_TOKENS", "48")
    with pytest.raises(ChunkTokensError, match="multiple of vLLM's block size"):
        settings(*config(block_size=32))


def test_a_model_that_is_not_one_group_of_full_attention_is_refused() -> None:
    with pytest.raises(UnsupportedModel, match="one group of full attention"):
        settings(*config(spec=SlidingWindowSpec(block_size=32, sliding_window=4096)))
