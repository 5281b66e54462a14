"""Fixtures shared by test folders."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from .integrations.engines import Reference, write_models

ALONE_MARK = "pytest.mark.alone"
"""What `tests/run` looks for to find the files of the tests it runs one at a time: it
collects only those files (docs/testing.md, "In parallel")."""


@cache
def _says_alone(path: Path) -> bool:
    return ALONE_MARK in path.read_text()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked `alone` in a file that does not say `pytest.mark.alone` (a mark applied
    some other way) would run in neither of `tests/run`'s runs: refuse it."""
    for item in items:
        if item.get_closest_marker("alone") and not _says_alone(item.path):
            raise pytest.UsageError(f"{item.nodeid} is marked alone, but its file does not say "
                                    f"{ALONE_MARK}: tests/run would never run it")


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
