"""`python ARGS` of the vLLM environment, forked from the test run's zygote (`zygote.py`, at
$KVPOOL_TEST_ZYGOTE) instead of started afresh: the vLLM part of `kvpool bench`, which
starts its engines and writes its model with $KVPOOL_VLLM_PYTHON, is given a `python` that
runs this (`tests/bench/test_bench_vllm.py`). The process forked runs ARGS with this one's
environment, working directory, stdin, stdout and stderr; this one passes on the signals
it gets and ends as that one does.

Standard library only: it runs in whichever Python runs the tests, started for each
engine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

ENV_ZYGOTE = "KVPOOL_TEST_ZYGOTE"


def main() -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.environ[ENV_ZYGOTE])
    assert json.loads(sock.recv(1 << 16)) == {"ready": True}
    request = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
    pid = json.loads(sock.recv(1 << 16))["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _: os.kill(pid, s))
    while (reply := json.loads(sock.recv(1 << 16))).get("exit") != pid:
        pass
    code = reply["code"]
    if code < 0:  # killed by a signal: this process too, as the caller would see it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
