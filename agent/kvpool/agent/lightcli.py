"""The `kvpool` command where only the client is installed (docs/client.md, "Installing the
client in an inference image"): `kvpool stats` and `kvpool --version` work there, with the
standard library and the client alone; every other command says it needs the full install.

Same rules as the full command: errors are one line, `error: ...`, usage errors exit 2;
`--socket`, else `$KVPOOL_SOCKET`, else the agent's default socket.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn

from . import __version__
from .constants import ENV_SOCKET
from .statsview import plain

USAGE = 2
FULL_COMMANDS = ("agent", "cleanup", "events", "demo", "bench", "gc", "crds", "render",
                 "operator")
"""The full command's other commands: they need the agent's dependencies."""


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _fail(message)


def _fail(message: str, code: int = USAGE) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="kvpool", description="kvpool, client-only install: the agent's stats from an "
        "inference pod. The other commands need the full install (pip install kvpool with "
        "its dependencies).")
    parser.add_argument("--version", action="store_true", help="Print kvpool's version.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND",
                                     parser_class=_OneLineParser)
    stats = commands.add_parser("stats", help="Show an agent's tiers, hits, leases and health.")
    stats.add_argument("--socket", metavar="PATH", help=f"The agent's socket (default: "
                       f"${ENV_SOCKET}, else the agent's default).")
    stats.add_argument("--json", action="store_true", help="Print JSON.")
    return parser


def main(argv: list[str], missing: str) -> int:
    """Run the client-only command; `missing` is the dependency of the full one not found."""
    if argv and argv[0] in FULL_COMMANDS:
        _fail(f"kvpool {argv[0]} needs the full kvpool install ({missing} and the rest of "
              f"its dependencies are not installed here); this client-only install runs "
              f"kvpool stats and kvpool --version")
    args = _parser().parse_args(argv)
    if args.version:
        print(f"kvpool {__version__}")
        return 0
    if args.command != "stats":
        _parser().print_help()
        return 0
    from .client import KVPoolClient, default_socket

    path = default_socket(args.socket)
    try:
        with KVPoolClient(path, mode="inline", reconnect_timeout=0) as c:
            data = c.stats()
    except OSError as e:
        where = f"--socket {path}" if args.socket else (
            f"{path} (from ${ENV_SOCKET})" if os.environ.get(ENV_SOCKET)
            else f"{path} (the agent's default)")
        _fail(f"{where}: cannot reach the agent: {e.strerror or e}")
    print(json.dumps(data) if args.json else plain(data))
    return 0
