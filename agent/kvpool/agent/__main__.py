"""`python -m kvpool.agent` is the `kvpool` command."""

from .command import main

main()
