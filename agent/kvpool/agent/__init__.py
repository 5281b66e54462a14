"""kvpool node agent: tiered KV-cache store, socket server, client library and CLI."""

__version__ = "0.1.0"
