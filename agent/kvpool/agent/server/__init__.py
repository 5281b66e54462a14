"""The agent process: framing and dispatch of client connections (connection.py,
dispatch.py), and the agent's wiring — spaces, sockets, housekeeping, policy reload,
HTTP (agent.py, space.py, http.py)."""

from __future__ import annotations

from .agent import HOUSEKEEPING_INTERVAL, Agent, run_agent
from .connection import Closed, Connection
from .dispatch import Dispatcher
from .space import Space

__all__ = ["HOUSEKEEPING_INTERVAL", "Agent", "Closed", "Connection", "Dispatcher", "Space",
           "run_agent"]
