"""Every code block in README.md and docs/ that claims to run, run as a reader would.

The convention (docs/testing.md): every fenced block names its language. `python` and `sh`
blocks are run here, unless the line just above the fence is an HTML comment
`<!-- not run: REASON -->` saying why not (a Kubernetes cluster, a GPU, an inference engine,
the network). Other languages (`yaml`, `text`, ...) are data or pictures and are not run.

A `python` block runs in a fresh interpreter in an empty directory; an `sh` block runs in
bash (`set -euo pipefail`) in a copy of the checkout's tracked files (what it writes never
lands in the checkout), with the `kvpool` command of this interpreter first on PATH. Both run
with `KVPOOL_SOCKET` set to a real agent started for this module, as in an inference pod the
webhook has prepared. A block that would change the machine (install packages, drive a
cluster) must be marked: the test refuses to run one that is not.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool.bench.local import LocalAgent

from .support import REPO_ROOT

RUN = ("python", "sh")
"""Languages whose blocks are run."""

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")
_CHANGES_THE_MACHINE = re.compile(
    r"\b(pip3? (install|uninstall|wheel)|python3? -m pip|apt-get|apt|sudo|helm|kubectl|"
    r"systemctl|docker|podman|buildah)\b")
"""Commands a run block must not hold: they change this machine or need a cluster."""


@dataclass(frozen=True)
class Block:
    path: str
    """Relative to the repository root."""
    line: int
    """Of the opening fence, 1-based."""
    language: str
    code: str
    not_run: str | None
    """Why the block is not run, from the comment above it; None: it is run."""

    @property
    def runs(self) -> bool:
        return self.language in RUN and self.not_run is None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(text: str, path: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, with their language and not-run reason."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        language = (m["info"].split() or [""])[0]
        skip = _NOT_RUN.match(lines[i - 1]) if i > 0 else None
        body = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        out.append(Block(path, i + 1, language, "\n".join(body) + "\n",
                         skip["reason"] if skip else None))
        i = j + 1
    return out


def doc_files() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("**/*.md"))]


def all_blocks() -> list[Block]:
    return [b for f in doc_files()
            for b in blocks(f.read_text(), str(f.relative_to(REPO_ROOT)))]


# --------------------------------------------------------------------------- the convention


def test_blocks_are_found_with_their_language_and_reason() -> None:
    text = (
        "Intro\n"
        "```python\nprint(1)\n```\n"
        "<!-- not run: needs a Kubernetes cluster -->\n"
        "```sh\nkubectl get pods\n```\n"
        "- a list item:\n\n"
        "  ```sh\n  kvpool --version\n  ```\n"
        "```text\n+---+\n```\n"
    )
    assert blocks(text, "x.md") == [
        Block("x.md", 2, "python", "print(1)\n", None),
        Block("x.md", 6, "sh", "kubectl get pods\n", "needs a Kubernetes cluster"),
        Block("x.md", 11, "sh", "kvpool --version\n", None),
        Block("x.md", 14, "text", "+---+\n", None),
    ]
    assert [b.runs for b in blocks(text, "x.md")] == [True, False, True, False]


def test_every_block_names_its_language_and_every_skip_gives_a_reason() -> None:
    found = all_blocks()
    assert [str(b) for b in found if not b.language] == []
    assert [str(b) for b in found if b.not_run is not None and not b.not_run] == []
    assert [str(b) for b in found if b.not_run is not None and b.language not in RUN] == []
    assert any(b.runs and b.language == "python" for b in found)


def test_no_block_that_runs_installs_packages_or_drives_a_cluster() -> None:
    """Such a block would change the machine the tests run on: mark it `not run`."""
    assert [str(b) for b in all_blocks() if b.runs and _CHANGES_THE_MACHINE.search(b.code)] \
        == []


# --------------------------------------------------------------------------- running them


@pytest.fixture(scope="module")
def agent() -> Iterator[LocalAgent]:
    with LocalAgent("--no-lock", dram="128Mi") as a:
        yield a


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout's tracked files, where `sh` blocks run."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True,
                            timeout=60, check=True).stdout.decode().split("\0")
    root = tmp_path_factory.mktemp("checkout")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    return root


def _env(agent: LocalAgent) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "KVPOOL_SOCKET": str(agent.socket_path),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.mark.parametrize("block", [b for b in all_blocks() if b.runs], ids=str)
def test_docs_example_runs(block: Block, agent: LocalAgent, checkout: Path,
                           tmp_path: Path) -> None:
    assert not _CHANGES_THE_MACHINE.search(block.code), f"{block}: mark it `not run`"
    if block.language == "python":
        script = tmp_path / "example.py"
        script.write_text(block.code)
        argv, cwd = [sys.executable, str(script)], tmp_path
    else:
        argv, cwd = ["bash", "-c", "set -euo pipefail\n" + block.code], checkout
    run = subprocess.run(argv, cwd=cwd, env=_env(agent), capture_output=True, text=True,
                         timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, f"{block} failed:\n{block.code}\n{run.stdout}\n{run.stderr}"


_PIP_INSTALL = re.compile(r"pip install\b[^`\n]*(?:\\\n[^`\n]*)*")


def test_no_doc_installs_kvpool_from_a_package_index() -> None:
    """kvpool is on no package index: every `pip install` of it in the docs installs a
    checkout (`.`) or wheels found locally (`--no-index --find-links`), never its name
    from an index (`pip install 'kvpool[lmcache]'` failed for every reader)."""
    from_index = []
    for path in doc_files():
        for m in _PIP_INSTALL.finditer(path.read_text()):
            words = m.group(0).replace("\\\n", " ").split()
            ends = [i for i, w in enumerate(words) if w in ("&&", "||", "|", ";")
                    or w.startswith("#")]
            words = words[:ends[0]] if ends else words  # this command only
            names = [w.strip("'\"") for w in words[2:] if not w.startswith("-")]
            if any(re.fullmatch(r"kvpool(\[.*\])?", n) for n in names) \
                    and "--no-index" not in words:
                from_index.append(f"{path.relative_to(REPO_ROOT)}: {m.group(0)}")
    assert from_index == []
