"""The atheris target's checks hold on its seeds and on the inputs that found bugs, so the
target keeps working between the nightly runs that use it (docs/testing.md)."""

from __future__ import annotations

import pytest

from .fuzz_frames import fuzz_one_input, seeds

FOUND = [
    b"\x94\x01\x01\x01\xa2\xff\xfe",  # invalid UTF-8 in HELLO's client name
    b"\x93\x0d\x01" + b"\x91" * 100_000 + b"\xc0",  # nesting past the recursion limit
    b"\x92\xcc\xc8\x01",  # tag 200, not a fixint
]


@pytest.mark.parametrize("data", seeds() + FOUND)
def test_fuzz_target_checks_pass(data: bytes) -> None:
    fuzz_one_input(data)
    fuzz_one_input(data[4:])  # the body alone, as a stream it is garbage
    for cut in range(0, len(data), max(1, len(data) // 8)):
        fuzz_one_input(data[:cut])
