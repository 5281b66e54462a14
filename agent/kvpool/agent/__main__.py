"""`python -m kvpool.agent` is the `kvpool` command."""

from .cli import main

main()
