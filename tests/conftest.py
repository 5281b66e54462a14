"""Fixtures shared by test folders."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The vLLM engine tests' model (`tests/integrations/vllm_engine.py model`), written once
    per test run: every vLLM engine module (tests/integrations, tests/peers) serves the same
    one, and writing it costs an import of transformers in the vLLM environment."""
    from .integrations.test_vllm_engine import HARNESS, vllm_python

    model = tmp_path_factory.mktemp("vllm-model") / "model"
    subprocess.run([str(vllm_python()), str(HARNESS), "model", str(model)], check=True,
                   capture_output=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return model
