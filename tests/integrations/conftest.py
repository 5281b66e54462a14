"""Real agent processes for the integration tests (the agent tests' fixtures)."""

from ..agent.conftest import agent, client

__all__ = ["agent", "client"]
