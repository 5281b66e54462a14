"""The command line of the modules whose output the chart ships as a file (the Grafana
dashboard, the alert rules): `python -m kvpool.operator.<module> [FILE]`."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def print_or_write(render: Callable[[], str], argv: list[str] | None = None) -> int:
    """Print what `render` makes, or write it to the file named by the one argument."""
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if args:
        Path(args[0]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0
