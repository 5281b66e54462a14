"""tests/install's pip step as a user sees it: silent on success, pip's own words on failure.

Each test installs hand-made wheels into a virtual environment of its own (no network, no
index), through tests/pip-install with that environment active, as tests/install runs it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from .support import REPO_ROOT

PIP_INSTALL = REPO_ROOT / "tests" / "pip-install"


def make_wheel(where: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal pure-Python wheel declaring `requires`."""
    path = where / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"",
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                             + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: kvpool-tests\nRoot-Is-Purelib: true\n"
                         b"Tag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for name_in_zip, data in files.items():
            z.writestr(name_in_zip, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{name_in_zip},sha256={digest.decode()},{len(data)}")
        record.append(f"{info}/RECORD,,")
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment variables of a shell with a fresh virtual environment active."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(root)
    return {**os.environ, "VIRTUAL_ENV": str(root),
            "PATH": f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}"}


def pip_install(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PIP_INSTALL), *args], capture_output=True, text=True, env=env,
                          timeout=600, stdin=subprocess.DEVNULL)


def version(env: dict[str, str], name: str) -> str:
    probe = subprocess.run(
        ["python", "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
        env=env, capture_output=True, text=True, timeout=120)
    return probe.stdout.strip()


def test_a_successful_install_prints_nothing_though_pip_reports_conflicts(
        env: dict[str, str], tmp_path: Path) -> None:
    """The engines' case: a package installed --no-deps whose pin is not met makes pip print
    `ERROR: pip's dependency resolver ...` on a later install that succeeds."""
    pinned = make_wheel(tmp_path, "kvpool_test_pinned", "1.0", ("kvpool_test_base==2.0",))
    assert pip_install(env, "--no-index", "--no-deps", str(pinned)).returncode == 0
    plain = subprocess.run(
        ["python", "-m", "pip", "install", "-q", "--no-index",
         str(make_wheel(tmp_path, "kvpool_test_base", "1.0"))],
        env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert plain.returncode == 0 and "ERROR" in plain.stderr  # pip alone: success, "ERROR"
    run = pip_install(env, "--no-index", str(make_wheel(tmp_path, "kvpool_test_base", "1.1")))
    assert run.returncode == 0, run.stderr
    assert run.stdout == "" and run.stderr == ""
    assert version(env, "kvpool_test_base") == "1.1"


def test_a_failed_install_shows_pips_output_and_its_exit_status(env: dict[str, str]) -> None:
    run = pip_install(env, "--no-index", "kvpool-test-nowhere==1.0")
    assert run.returncode != 0
    assert "kvpool-test-nowhere" in run.stderr and "ERROR" in run.stderr
    assert run.stderr.rstrip().endswith(f"failed (exit {run.returncode})")


def test_pytest_starts_without_a_deprecation_warning() -> None:
    """A fresh run of the suite's configuration (pyproject.toml) warns about nothing, e.g.
    pytest-asyncio's "asyncio_default_fixture_loop_scope is unset"."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
         "-W", "error::DeprecationWarning", "tests/test_layout.py"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Deprecation" not in run.stdout + run.stderr
