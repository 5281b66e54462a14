"""The pool's secret and the agent's TLS files, read again whenever they change.

The operator mounts both from Secrets in a projected volume, which the kubelet updates in
place when a Secret changes: a certificate that cert-manager renewed, a pool secret an
admin rotated (docs/cross-node.md, "Rotating the secret and renewing certificates"). Read
once at the start, a renewed certificate was ignored until the agent restarted, and once
the old one expired every new connection between agents failed its handshake; a rotated
secret split the pool between the agents started before it and those started after.

Each agent looks at the files every `RELOAD_SECONDS` and takes what changed for the next
connections (made and accepted); connections up already keep going. A file that does not
load (a secret too short, a key that does not match its certificate, one written half)
changes nothing: the agent goes on with what it had, logs it, counts it, and reads it again
once it changes.

**A rotated secret, with a grace.** The kubelets of different nodes update their copies of
a Secret up to a minute or two apart. An agent proves the secret its file holds now; for
`peers.secretGrace` after it sees a new one it still accepts a proof of the previous one
from the agents it connects to (those whose node has not updated its copy yet). Then the
previous secret is accepted no more, and every connection proven with it ends (`stale`):
an agent that still knows only the old secret is cut off, what a rotation after a leak
needs. Meanwhile an agent not updated yet cannot open a connection to one that is (it
cannot check the new secret's proof); its connections up already stay until that agent's
grace ends, by which time its own copy should be updated. An agent started after the
rotation (it knows the new secret only) reaches every agent updated before it at once.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable
from pathlib import Path

from ..config import ConfigError, Peers
from . import auth
from .metrics import PeerMetrics

log = logging.getLogger("kvpool.agent.peers")

RELOAD_SECONDS = 2.0
"""How often the secret and TLS files are looked at (a few small reads)."""


def tls_contexts(cfg: Peers) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(server, client) TLS contexts from the files `cfg.tls` names: each side shows its
    certificate and requires one signed by the pool's CA. Agents are reached by IP, so the
    name is not checked: the CA is the pool's own."""
    if cfg.tls is None:
        return None, None
    t = cfg.tls
    for path in (t.cert_file, t.key_file, t.ca_file):  # (ssl's errors do not name the file)
        try:
            with path.open("rb"):
                pass
        except OSError as e:
            raise OSError(e.errno, f"{path}: {e.strerror}") from None
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(t.ca_file))
    server.load_cert_chain(str(t.cert_file), str(t.key_file))
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(t.ca_file))
    client.load_cert_chain(str(t.cert_file), str(t.key_file))
    client.check_hostname = False
    return server, client


class Credentials:
    """What an agent proves to its peers and checks of them: the pool's secret (and, for
    `secretGrace` after a rotation, the previous one, accepted from the agents it connects
    to) and its TLS contexts, as its files say now (`refresh`)."""

    def __init__(self, cfg: Peers, metrics: PeerMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Raises ConfigError where the files do not load: at the start, the agent cannot
        serve without them."""
        assert cfg.secret_file is not None  # the config requires it when enabled
        self.cfg = cfg
        self.m = metrics
        self.clock = clock
        try:
            self.secret = auth.read_secret(cfg.secret_file)
        except (OSError, ValueError) as e:
            raise ConfigError(f"peers.secretFile: {e}") from e
        self.previous: bytes | None = None
        """The secret before the last rotation, while it is accepted (`secretGrace`)."""
        self._accept_until = 0.0
        self._secret_seen = self._read(cfg.secret_file)
        try:
            self.server_tls, self.client_tls = tls_contexts(cfg)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"peers.tls: {e}") from e
        self._tls_seen = self._tls_files()
        self._certificate_taken(self._tls_seen)
        self.listening: ssl.SSLContext | None = None
        """The context the server listens with: it hands each handshake to the current
        server context (a certificate and CA read after the listener was made)."""
        if self.server_tls is not None:
            self.listening = self.server_tls
            self.listening.sni_callback = self._current_server_context

    # -- what the handshakes use

    def accepted(self) -> tuple[bytes, ...]:
        """The secrets a server's proof may be made with, the current one first."""
        return (self.secret,) if self.previous is None else (self.secret, self.previous)

    def stale(self, proven: bytes) -> bool:
        """Whether a connection proven with this secret is to end: the secret is no longer
        accepted (a rotation's grace is over)."""
        return proven not in self.accepted()

    def _current_server_context(self, conn: ssl.SSLObject | ssl.SSLSocket, name: str | None,
                                ctx: ssl.SSLContext) -> None:
        # Called in every handshake's ClientHello (with no name: agents are reached by IP);
        # the certificate and the CA checked are those of the context set here.
        if self.server_tls is not None and self.server_tls is not ctx:
            conn.context = self.server_tls

    # -- reading the files again

    def refresh(self) -> bool:
        """Take what changed in the files since the last look, and end a grace that ran
        out; True when a secret stopped being accepted: the connections proven with it are
        to end (`stale`)."""
        before = self.accepted()
        self._refresh_secret()
        self._refresh_tls()
        if self.previous is not None and self.clock() >= self._accept_until:
            self.previous = None
            log.info("peers: the previous pool secret's grace is over: it is no longer "
                     "accepted, and connections proven with it end")
        return any(s not in self.accepted() for s in before)

    def _refresh_secret(self) -> None:
        path = self.cfg.secret_file
        assert path is not None
        seen = self._read(path)
        if seen == self._secret_seen:
            return
        self._secret_seen = seen
        try:
            secret = auth.read_secret(path)
        except (OSError, ValueError) as e:
            self._count("secret", "error")
            log.error("peers.secretFile changed but cannot be used, the pool secret in use "
                      "stays: %s", e)
            return
        if secret == self.secret:
            return
        grace = self.cfg.secret_grace
        # (A secret rotated again within a grace: the one before the last is dropped.)
        self.previous = self.secret
        self.secret = secret
        self._accept_until = self.clock() + grace
        self._count("secret", "ok")
        log.info("peers: the pool secret changed; the previous one is still accepted from "
                 "the agents this one connects to for %gs", grace)

    def _refresh_tls(self) -> None:
        if self.cfg.tls is None:
            return
        seen = self._tls_files()
        if seen == self._tls_seen:
            return
        self._tls_seen = seen
        try:
            server, client = tls_contexts(self.cfg)
        except (OSError, ssl.SSLError, ValueError) as e:
            self._count("tls", "error")
            log.error("peers.tls files changed but do not load, the certificate in use "
                      "stays: %s", e)
            return
        self.server_tls, self.client_tls = server, client
        self._certificate_taken(seen)
        self._count("tls", "ok")
        log.info("peers: TLS certificate, key or CA changed: new connections use them")

    def _certificate_taken(self, seen: tuple[bytes | None, ...]) -> None:
        """Publish when the certificate now in use expires (its first, in a chain), from
        the files' bytes as read (`_tls_files`): an alert warns before it does, whether its
        renewal failed or never reached the files (`KVPoolPeerCertificateExpiring`)."""
        if not seen or self.m is None:
            return
        from cryptography import x509  # (only with TLS on)

        try:
            if seen[0] is None:
                raise ValueError("the certificate file could not be read")
            cert = x509.load_pem_x509_certificate(seen[0])
        except ValueError as e:  # (loaded by ssl a moment ago: changed since)
            log.warning("peers.tls: the certificate's expiry cannot be read: %s", e)
            return
        self.m.certificate_expires(cert.not_valid_after_utc.timestamp())

    def _tls_files(self) -> tuple[bytes | None, ...]:
        t = self.cfg.tls
        if t is None:
            return ()
        return tuple(self._read(p) for p in (t.cert_file, t.key_file, t.ca_file))

    @staticmethod
    def _read(path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except OSError:
            return None  # (a missing file is a change too, reported when it is loaded)

    def _count(self, what: str, result: str) -> None:
        if self.m is not None:
            self.m.reloaded(what, result)
