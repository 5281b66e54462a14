"""The pool-secret handshake: both sides prove they hold the pool's secret before any
chunk or inventory moves.

Each side sends a fresh 32-byte nonce and its agent id; the server answers with an
HMAC-SHA256 over both nonces and both ids (labelled "server"), the client checks it in
constant time and answers with its own (labelled "client"), which the server checks
likewise. Neither proof can be replayed (each covers the other side's fresh nonce) or
reflected (the labels differ). During a rotated secret's grace a client accepts a proof
of the previous secret too, and answers with the one the server proved (`credentials`).
The secret itself never crosses the wire. What it does
not give: confidentiality of the bytes, or protection against a relay between two real
agents; TLS (`peers.tls`) gives both (docs/cross-node.md).

An agent id's first `KERNEL_TAG_BYTES` name the kernel the agent runs on (`kernel_tag`),
the rest are random per process: a holder whose reader shares its kernel (the nodes of a
kind cluster, the demo's, the tests' network namespaces) sends it arena bytes by copy, not
by reference (`server.ChunkSource.copy_out`). A reader that lies about it only risks its
own reads failing their checksum.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
from pathlib import Path

from . import wire

NONCE_BYTES = 32
MIN_SECRET_BYTES = 16
KERNEL_TAG_BYTES = 4
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
"""The running kernel's id, the same in every container and network namespace on it."""


class AuthError(Exception):
    """The other side did not prove the pool's secret (or broke the handshake)."""


def read_secret(path: Path) -> bytes:
    """The pool's secret from its file (surrounding whitespace ignored); ValueError when it
    is too short to be one."""
    secret = path.read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{path}: a pool secret needs at least {MIN_SECRET_BYTES} bytes, "
                         f"it holds {len(secret)}")
    return secret


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


@functools.cache
def kernel_tag() -> bytes:
    """`KERNEL_TAG_BYTES` naming the kernel this process runs on (a hash of its boot id);
    random where there is none to read (then no other agent shares it)."""
    try:
        boot = BOOT_ID.read_bytes().strip()
    except OSError:
        return os.urandom(KERNEL_TAG_BYTES)
    return hashlib.sha256(b"kvpool-kernel/" + boot).digest()[:KERNEL_TAG_BYTES]


def new_agent_id() -> bytes:
    """An agent's id for its process's life: its kernel's tag, then random bytes."""
    return kernel_tag() + os.urandom(wire.AGENT_ID_BYTES - KERNEL_TAG_BYTES)


def same_kernel(agent_id: bytes) -> bool:
    """Whether the agent whose id this is runs on this process's kernel: bytes it
    receives from a socket may still be references to this process's pages."""
    return agent_id[:KERNEL_TAG_BYTES] == kernel_tag()


def hello(agent_id: bytes, my_nonce: bytes) -> bytes:
    return wire.HELLO.pack(wire.MAGIC, wire.VERSION, agent_id, my_nonce)


def parse_hello(data: bytes) -> tuple[bytes, bytes]:
    """(agent id, nonce) of the other side's HELLO."""
    magic, version, agent_id, their_nonce = wire.HELLO.unpack(data)
    if magic != wire.MAGIC:
        raise AuthError("not a kvpool peer (bad magic)")
    if version != wire.VERSION:
        raise AuthError(f"peer protocol version {version}, this agent speaks {wire.VERSION}")
    return bytes(agent_id), bytes(their_nonce)


def proof(secret: bytes, label: bytes, client_nonce: bytes, server_nonce: bytes,
          client_id: bytes, server_id: bytes) -> bytes:
    msg = b"kvpool-peer/" + label + client_nonce + server_nonce + client_id + server_id
    return hmac.new(secret, msg, hashlib.sha256).digest()


def proved(secrets: tuple[bytes, ...], label: bytes, client_nonce: bytes, server_nonce: bytes,
           client_id: bytes, server_id: bytes, got: bytes) -> bytes:
    """Which of `secrets` the proof `got` was made with (each compared in constant time);
    AuthError where none."""
    for secret in secrets:
        if hmac.compare_digest(proof(secret, label, client_nonce, server_nonce, client_id,
                                     server_id), got):
            return secret
    raise AuthError("the pool secret's proof does not match")


def check(expected: bytes, got: bytes) -> None:
    if not hmac.compare_digest(expected, got):
        raise AuthError("the pool secret's proof does not match")
