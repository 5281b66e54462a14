"""The connector's connection to the node's agent, allowed to be missing.

vLLM must keep serving when the agent is not there (not started yet, killed, restarting,
stalled): every call through an `AgentLink` either works or returns None at once, which the
connector treats as a miss (a lookup finds nothing, a load fails and vLLM recomputes, a save
is skipped). One warning per incident, when the agent is first found unreachable, and one
info line when it is back: never one per request. The link reconnects by itself on a later
call, at most every `retry_every` seconds, so a dead agent costs a connect attempt, not a
wait per request. A stalled agent costs each blocked call the client's socket `timeout`,
after which the link is down like a dead one.

A link is used from one thread only (a `KVPoolClient` is not thread-safe).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ...client import KVPoolClient

LOGGER = "vllm.kvpool"
"""The connector logs under vLLM's logger, so its lines come with vLLM's own, at its level."""
log = logging.getLogger(LOGGER)
T = TypeVar("T")


class AgentLink:
    def __init__(self, socket_path: str | None, *, what: str, retry_every: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, **client_args: Any) -> None:
        self.socket_path = socket_path
        self.what = what
        self.retry_every = retry_every
        self.client_args = client_args
        self._clock = clock
        self.client: KVPoolClient | None = None
        self.down_since: float | None = None
        """When the current incident began (None: the agent answers, or never tried)."""
        self.incidents = 0
        self._next_try = 0.0

    def connected(self) -> KVPoolClient | None:
        """The live client, connecting first if the last attempt is old enough; None while
        the agent is unreachable. A connection the agent closed (it restarted) is replaced
        at once, with no warning when the agent answers again."""
        reconnecting = False
        if self.client is not None:
            if self.client.connected:
                return self.client
            self._close_client()
            self._next_try, reconnecting = 0.0, True
        now = self._clock()
        if now < self._next_try:
            return None
        self._next_try = now + self.retry_every
        try:
            # reconnect_timeout 0: a call whose connection dropped tries one reconnect, not a
            # backoff of seconds; the link retries later by itself.
            self.client = KVPoolClient(self.socket_path, reconnect_timeout=0.0,
                                       **self.client_args)
        except Exception as e:  # no agent is a state, not an error of vLLM's
            self._fail(e)
            return None
        if self.down_since is not None:
            log.info("kvpool %s: agent at %s is back after %.1fs", self.what,
                     self.client.socket_path, now - self.down_since)
        elif reconnecting:
            log.info("kvpool %s: reconnected to the agent at %s", self.what,
                     self.client.socket_path)
        else:
            assert self.client.hello is not None
            log.info("kvpool %s: pool %s at %s", self.what, self.client.hello.pool,
                     self.client.socket_path)
        self.down_since = None
        return self.client

    def call(self, fn: Callable[[KVPoolClient], T]) -> T | None:
        """`fn(client)`, or None when the agent cannot be reached or the call fails."""
        client = self.connected()
        if client is None:
            return None
        try:
            return fn(client)
        except Exception as e:  # never an exception out of the connector
            self._fail(e)
            return None

    def _close_client(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):  # closing a broken connection
                self.client.close()
            self.client = None

    def _fail(self, error: BaseException) -> None:
        self._close_client()
        if self.down_since is None:
            self.down_since = self._clock()
            self.incidents += 1
            log.warning("kvpool %s: agent at %s unreachable (%s: %s); serving without the "
                        "pool (recomputing) until it is back", self.what,
                        self.socket_path, type(error).__name__, error)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
