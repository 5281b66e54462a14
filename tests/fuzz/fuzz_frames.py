"""Coverage-guided fuzz target (atheris) for the agent's frame decoder, run in-process.

Feeds arbitrary bytes to what the agent does with a frame before any op runs
(`kvpool.agent.protocol`): split a stream by length prefix, decode each body into a
request (type validation of every op's fields), tell an unknown op from a malformed
frame (`peek_tag`), and the same for the client's reply decoder. Properties:

- decoding raises nothing but msgspec.DecodeError (ValidationError is one): anything
  else escapes the server's handlers and drops the connection without the documented
  BAD_FRAME (this found invalid UTF-8 and deep nesting);
- `peek_tag` never raises;
- a body that decodes is a request of a known op and survives encode → decode unchanged.

Not collected by pytest (tests/fuzz/test_fuzz_frames.py runs the seeds in CI). By hand or
nightly, from the repository root (docs/testing.md):

    python tests/fuzz/fuzz_frames.py -max_total_time=600 fuzz-corpus/

The corpus folder is seeded with one valid frame of every op when empty; a crash is
written to ./crash-<sha1> and reproduced with `python tests/fuzz/fuzz_frames.py crash-…`.
atheris instruments Python code only: msgspec's C decoder is exercised, not guided.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from kvpool.agent import protocol as p

OPS = {int(op) for op in p.Op}
MAX_FRAMES = 16
"""Frames looked at per input (keeps every input quick)."""


def check_request_body(body: bytes) -> None:
    try:
        req = p.request_decoder.decode(body)
    except msgspec.DecodeError:
        tag = p.peek_tag(body)  # what the server asks of a body it could not decode
        assert tag is None or type(tag) is int, tag
        return
    assert isinstance(req, p.Request), req
    assert type(req).__struct_config__.tag in OPS, req
    again = p.request_decoder.decode(p.encode(req)[p.HEADER.size :])
    assert again == req, (req, again)


def check_reply_body(body: bytes) -> None:
    try:
        reply = p.reply_decoder.decode(body)
    except msgspec.DecodeError:
        return
    assert isinstance(reply, p.Reply), reply
    if isinstance(reply, p.ErrorReply):
        p.ProtocolError(reply.code, reply.message)  # any code, known or not, makes an error
    again = p.reply_decoder.decode(p.encode(reply)[p.HEADER.size :])
    assert again == reply, (reply, again)


def fuzz_one_input(data: bytes) -> None:
    """The input as one body, then as a stream of length-prefixed frames."""
    check_request_body(data)
    check_reply_body(data)
    pos = 0
    for _ in range(MAX_FRAMES):
        if len(data) - pos < p.HEADER.size:
            break
        (length,) = p.HEADER.unpack_from(data, pos)
        body = data[pos + p.HEADER.size : pos + p.HEADER.size + length]
        check_request_body(body)
        pos += p.HEADER.size + len(body)


def seeds() -> list[bytes]:
    """A valid frame of every op and every reply: starting points for the mutator."""
    k = bytes(range(16))
    requests: list[p.Request] = [
        p.Hello(1, p.PROTOCOL_VERSION, "client", "tenant", 7), p.Lookup(2, [k, k]),
        p.Alloc(3, k, 4096, b"meta"), p.Commit(4, 5, 2**64 - 1), p.Abort(5, 5),
        p.Acquire(6, k), p.Release(7, 5), p.Put(8, k, b"data", p.checksum(b"data"), b"m"),
        p.Get(9, k), p.Delete(10, k), p.Pin(11, k), p.Unpin(12, k), p.Stats(13),
    ]
    replies: list[p.Reply] = [
        p.ErrorReply(1, int(p.ErrorCode.BAD_KEY), "bad key"),
        p.HelloReply(1, 1, "0.1.0", "pool", 1 << 20, 1 << 16, 4096, 1 << 17, 4096),
        p.LookupReply(2, 2, b"\x02\x03"), p.AllocReply(3, 5, [(0, 4096)]),
        p.AcquireReply(6, 5, 4, 9, [(4096, 4)], b"m", 2), p.GetReply(9, b"data", 9, b"", 2),
        p.StatsReply(13, {"tiers": {"dram": {"used_bytes": 0}}}),
    ]
    return [p.encode(m) for m in [*requests, *replies]]


def main() -> None:
    import atheris  # only here: the seeds and checks above run without it (CI)

    corpus = [Path(a) for a in sys.argv[1:] if not a.startswith("-")]
    if corpus and corpus[0].is_dir() and not any(corpus[0].iterdir()):
        for i, seed in enumerate(seeds()):
            (corpus[0] / f"seed-{i:02d}").write_bytes(seed)
    atheris.instrument_all()
    atheris.Setup(sys.argv, fuzz_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
