"""What the parts of `kvpool bench` need beyond kvpool itself, and what this machine lacks.

kvpool's own dependencies run every kvpool figure; some baselines and peers need more: the
Redis baseline of the data part (`redis-server` and the redis package), the G4 baseline of
the tiers part (a moto S3 server: `moto[server]`), the libCacheSim peers of the hit-ratio
part (`libcachesim`), the plots of `--out` (`matplotlib`), the peer part root and `ip`
(iproute2: its nodes are network namespaces) and the vllm part a vLLM environment
(tests/install-vllm, or $KVPOOL_VLLM_PYTHON). `pip install '.[bench]'` from
a checkout installs the packages; redis-server comes from the system (Debian:
`apt-get install redis-server`). A bench run leaves out what it cannot run and says so,
before it starts.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Need:
    what: str
    """What is missing, in words: `the redis package`."""
    how: str
    """How to get it: `pip install redis`."""
    present: Callable[[], bool]


def _importable(module: str) -> Callable[[], bool]:
    def present() -> bool:
        try:
            importlib.import_module(module)
        except ImportError:
            return False
        return True
    return present


def _program(name: str) -> Callable[[], bool]:
    return lambda: shutil.which(name) is not None


REDIS_SERVER = Need("the redis-server program", "apt-get install redis-server",
                    _program("redis-server"))
REDIS = Need("the redis package", "pip install redis", _importable("redis"))
MOTO_SERVER = Need("a moto S3 server", "pip install 'moto[server]'", _importable("moto.server"))
LIBCACHESIM = Need("the libcachesim package", "pip install libcachesim",
                   _importable("libcachesim"))
MATPLOTLIB = Need("the matplotlib package", "pip install matplotlib",
                  _importable("matplotlib"))

ROOT = Need("root (network namespaces)", "run it as root, e.g. sudo", lambda: os.geteuid() == 0)
IPROUTE = Need("the ip program", "apt-get install iproute2", _program("ip"))


def vllm_python() -> Path:
    """The vLLM environment's python: $KVPOOL_VLLM_PYTHON, else tests/install-vllm's place
    (`<sys.prefix>-vllm`)."""
    return Path(os.environ.get("KVPOOL_VLLM_PYTHON") or f"{sys.prefix}-vllm/bin/python")


VLLM = Need("a vLLM environment with kvpool in it",
            "tests/install-vllm from a checkout, or KVPOOL_VLLM_PYTHON=its python",
            lambda: vllm_python().exists())

WHOLE_PARTS: dict[str, tuple[Need, ...]] = {"data": (REDIS_SERVER, REDIS), "vllm": (VLLM,),
                                             "peer": (ROOT, IPROUTE)}
"""Parts that do not run at all without these (their figures are ratios to the baseline)."""
SECTIONS: dict[str, tuple[str, tuple[Need, ...]]] = {
    "g4": ("tiers", (MOTO_SERVER,)),
    "libcachesim": ("hit-ratio", (LIBCACHESIM,)),
}
"""Sections a part leaves out without these, running the rest: {section: (part, needs)}."""


def missing_words(needs: Collection[Need]) -> str:
    """`needs the redis package (pip install redis)`, for the needs that are absent."""
    return "needs " + " and ".join(f"{n.what} ({n.how})" for n in needs)


def left_out(parts: Collection[str], plots: bool) -> dict[str, str]:
    """{part or section left out: why}, for what this machine cannot run of `parts` (and
    of the plots, with `plots`)."""
    out: dict[str, str] = {}
    for part, needs in WHOLE_PARTS.items():
        absent = [n for n in needs if part in parts and not n.present()]
        if absent:
            out[part] = missing_words(absent)
    for section, (part, needs) in SECTIONS.items():
        absent = [n for n in needs if part in parts and not n.present()]
        if absent:
            out[section] = missing_words(absent)
    if plots and not MATPLOTLIB.present():
        out["plots"] = missing_words([MATPLOTLIB])
    return out
