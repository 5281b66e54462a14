"""What every `kvpool` command shares: errors are one line, `error: ...`, on stderr.

Click reports its own usage errors (an unknown flag, a missing value, a bad choice) as a
usage line, a hint and the error; `OneLineErrors` makes them the same one line as the
errors the commands raise themselves, with the same exit status (2).
"""

from __future__ import annotations

import sys
from typing import IO, TYPE_CHECKING, Any, NoReturn

import typer
from typer.core import TyperGroup

if TYPE_CHECKING:
    from rich.console import Console

USAGE = 2
"""Exit status of a usage error, the same as click's own."""


# click's UsageError, wherever this typer takes click from (newer releases vendor it).
_UsageError: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


UNBOUNDED_WIDTH = 10_000
"""Columns of a console whose output is not a terminal: wide enough that no line is cut."""


def console(stderr: bool = False) -> Console:
    """A rich console for stdout (or stderr) that cuts lines at the terminal's width only
    when it writes to a terminal: piped or captured, each line is printed whole (a table
    takes its natural width), as scripts and logs need."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=UNBOUNDED_WIDTH)


def fail(message: str, code: int = USAGE) -> NoReturn:
    """Say what was wrong in one line and exit with `code`."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


class _OneLineUsageError(_UsageError):  # type: ignore[valid-type,misc]
    def show(self, file: IO[Any] | None = None) -> None:
        typer.echo(f"error: {self.format_message()}", err=True, file=file)


def _one_line(e: Any) -> Exception:
    return e if isinstance(e, _OneLineUsageError) else _OneLineUsageError(e.format_message(), e.ctx)


class OneLineErrors(TyperGroup):
    """A Typer app's command group whose parse errors, and its subcommands', are one line."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None,
                     **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except _UsageError as e:
            raise _one_line(e) from e

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except _UsageError as e:
            raise _one_line(e) from e
