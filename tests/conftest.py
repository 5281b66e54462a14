"""Fixtures shared by test folders."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .integrations.engines import Reference, write_models


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The vLLM engine tests' model (`tests/integrations/vllm_engine.py model`), written once
    per test run: every vLLM engine module (tests/integrations, tests/peers) serves the same
    one, and writing it costs an import of transformers in the vLLM environment."""
    model = tmp_path_factory.mktemp("vllm-model") / "model"
    write_models((model, 0))
    return model


@pytest.fixture(scope="session")
def vllm_other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another model of `vllm_model`'s shape (weights from another seed), as a user deploys
    a second model, e.g. a fine-tune of the first: the same KV bytes per chunk, other KV."""
    model = tmp_path_factory.mktemp("vllm-other-model") / "model"
    write_models((model, 1))
    return model


@pytest.fixture(scope="session")
def vllm_reference(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[Reference]:
    """vLLM's engine with no connector at all on `vllm_model`: the greedy output each
    connector's run must equal. Started when a module first asks (beside the engines that
    module starts), kept for the run: every engine module asks the same one."""
    ref = Reference(vllm_model, tmp_path_factory.mktemp("vllm-reference"))
    ref.start()
    try:
        yield ref
    finally:
        ref.quit()
