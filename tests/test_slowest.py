"""tests/slowest.py: the ten slowest tests of tests/run's two pytest runs, in one list."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .support import REPO_ROOT


def report(path: Path, cases: dict[str, float]) -> Path:
    """A JUnit report as pytest writes it with junit_family=xunit1."""
    rows = "".join(f'<testcase classname="tests.x" file="tests/x.py" name="{name}" '
                   f'time="{t}" />' for name, t in cases.items())
    path.write_text(f'<testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')
    return path


def test_the_slowest_of_both_runs_come_first_and_a_missing_report_is_left_out(
        tmp_path: Path) -> None:
    parallel = report(tmp_path / "parallel.xml", {"a": 1.5, "b": 30.0, "c": 0.1})
    alone = report(tmp_path / "alone.xml", {"d": 12.25})
    run = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "slowest.py"), "2",
                          str(parallel), str(alone), str(tmp_path / "never-written.xml")],
                         capture_output=True, text=True, check=True)
    lines = run.stdout.splitlines()
    assert "slowest 2 tests" in lines[0]
    assert [line.split() for line in lines[1:]] == [["30.00s", "tests/x.py::b"],
                                                    ["12.25s", "tests/x.py::d"]]
