"""The `kvpool` entry point: the full command where kvpool's dependencies are installed,
else the client-only one (`lightcli`), so that `kvpool stats` works in an inference image
that installed the client alone (docs/client.md)."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from .cli import main as full
    except ImportError as e:  # a dependency of the full command (typer, pydantic, ...)
        if e.name is None or e.name.split(".")[0] == "kvpool":
            raise  # kvpool itself broken: not a light install
        from .lightcli import main as light

        sys.exit(light(sys.argv[1:], missing=e.name))
    full()
