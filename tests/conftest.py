"""Fixtures shared by test folders."""

from __future__ import annotations

from collections.abc import Generator, Iterator
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


LONGEST_FIRST = (
    "bench/test_bench_smoke.py",  # the quick bench run, one set-up of over a minute
    "agent/test_cli.py",
    "peers/test_peer_partition.py",  # one test waiting on a partition (~13 s)
    "peers/test_peer_credentials.py",  # a rotated secret's grace waited out (~20 s)
    "operator/test_op_faults.py",
    "chart/test_prometheus_live.py",
    "integrations/test_sglang_backend.py",
    "bench/test_bench_needs.py",
    "peers/test_directory.py",
    "agent/test_restart.py",
)
"""The files that take longest in CI (tests/slowest.py lists them), under tests/: the parallel
run hands them out first. The two processes take whole files, the next as one runs out: a
long file handed out last keeps one process busy while the other has nothing left."""


def _file_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` a file at a time (each file's tests in their order): `LONGEST_FIRST`, then the
    other files by their number of tests, most first (what pytest-xdist would do)."""
    files: dict[Path, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    here = Path(__file__).parent

    def rank(path: Path) -> tuple[int, int]:
        name = path.relative_to(here).as_posix() if path.is_relative_to(here) else ""
        first = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
        return first, -len(files[path])
    return [item for path in sorted(files, key=rank) for item in files[path]]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked `alone` in a file that does not say `pytest.mark.alone` (a mark applied
    some other way) would run in neither of `tests/run`'s runs: refuse it. In a process of
    the parallel run (pytest-xdist's worker), order the files longest first."""
    for item in items:
        if item.get_closest_marker("alone") and not _says_alone(item.path):
            raise pytest.UsageError(f"{item.nodeid} is marked alone, but its file does not say "
                                    f"{ALONE_MARK}: tests/run would never run it")
    if hasattr(config, "workerinput"):
        items[:] = _file_order(items)


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The vLLM engine tests' model (`tests/integrations/vllm_engine.py model`), written once
    per test run: every vLLM engine module (tests/integrations, tests/peers) serves the same
    one, and writing it is a process of the vLLM environment."""
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


AGENT_LOG_LINES = 40
"""Lines of each agent's log (its warnings and errors, the last ones) a failure report shows."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report carries what its agents logged at WARNING and above (each
    `agent.log` under its `tmp_path`): a failure that only a loaded CI machine shows is
    read from the CI log, not guessed at."""
    report = yield
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and isinstance(tmp, Path) and tmp.is_dir():
        for log in sorted(tmp.rglob("agent.log")):
            lines = [line for line in log.read_text(errors="replace").splitlines()
                     if '"level":"WARNING"' in line or '"level":"ERROR"' in line]
            if lines:
                report.sections.append((f"agent log: {log.relative_to(tmp)}",
                                        "\n".join(lines[-AGENT_LOG_LINES:])))
    return report
