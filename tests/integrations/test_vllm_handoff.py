"""Which node a request's saves are handed off to: the router names it in the request's
`kv_transfer_params`, as vLLM's P/D connectors take their per-request routing (no vLLM:
the request objects carry the attribute vLLM 0.32's `Request` has). The push itself is
proven across nodes in tests/peers/test_peer_handoff.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.agent.integrations.vllm.scheduler import PUSH_TO, push_target


@pytest.mark.parametrize(("params", "to"), [
    ({PUSH_TO: "decode-node-7"}, "decode-node-7"),
    ({PUSH_TO: "decode-node-7", "do_remote_decode": True}, "decode-node-7"),
    (None, None),  # vLLM's default: no params
    ({}, None),
    ({"remote_host": "10.0.0.7"}, None),  # another connector's routing is not ours
    ({PUSH_TO: ""}, None),
    ({PUSH_TO: 7}, None),  # not a node name: saved here only, never an error
    ("not a dict", None),
])
def test_a_request_names_the_node_its_saves_are_pushed_to(params: Any, to: str | None) -> None:
    assert push_target(SimpleNamespace(kv_transfer_params=params)) == to


def test_a_request_object_without_transfer_params_pushes_nowhere() -> None:
    assert push_target(SimpleNamespace()) is None
