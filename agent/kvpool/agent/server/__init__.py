"""The agent process: framing and dispatch of client connections (connection.py,
dispatch.py), and the agent's wiring — spaces, sockets, housekeeping, policy reload,
HTTP (agent.py, space.py, http.py)."""

from __future__ import annotations

from .agent import HOUSEKEEPING_INTERVAL, Agent, run_agent
from .connection import FRAME_TIMEOUT, SEND_TIMEOUT, Closed, Connection
from .dispatch import Dispatcher
from .space import Space

__all__ = ["FRAME_TIMEOUT", "HOUSEKEEPING_INTERVAL", "SEND_TIMEOUT", "Agent", "Closed",
           "Connection", "Dispatcher", "Space", "run_agent"]
