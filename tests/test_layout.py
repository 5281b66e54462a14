"""The checkout's layout shadows nothing: every `python` started at the repository root
(`python -m pytest`, `python -m pip`, the REPL, a script saved there) imports the standard
library, not a folder of this repository."""

from __future__ import annotations

import subprocess
import sys

from .support import REPO_ROOT


def test_import_operator_at_the_repository_root_is_the_standard_librarys() -> None:
    # `python -c` puts the working directory first on sys.path, as `python -m` does.
    probe = ("import sys, operator, sysconfig; "
             "assert sys.path[0] in ('', sys.argv[1]), sys.path[0]; "
             "operator.itemgetter; "
             "print(operator.__file__)")
    run = subprocess.run([sys.executable, "-c", probe, str(REPO_ROOT)], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    stdlib = subprocess.run([sys.executable, "-c",
                             "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
                            capture_output=True, text=True, timeout=60).stdout.strip()
    assert run.stdout.strip().startswith(stdlib), run.stdout


def test_no_folder_at_the_root_is_a_package_named_like_a_standard_library_module() -> None:
    packages = {p.name for p in REPO_ROOT.iterdir() if (p / "__init__.py").exists()}
    assert not packages & sys.stdlib_module_names, packages & sys.stdlib_module_names


def test_agent_and_operator_are_source_roots_of_the_kvpool_namespace() -> None:
    for root, package in (("agent", "agent"), ("agent", "bench"), ("operator", "operator")):
        assert not (REPO_ROOT / root / "__init__.py").exists()
        assert not (REPO_ROOT / root / "kvpool" / "__init__.py").exists()
        assert (REPO_ROOT / root / "kvpool" / package / "__init__.py").exists()
