"""Engine processes forked from one that imported vLLM already (run in the vLLM environment).

    python zygote.py FD

An engine start costs ~14 s of CPU, ~11 of them importing vLLM, torch and transformers:
the engine tests start a dozen. This process imports them once, says {"ready": true} on
the socket FD (a SOCK_SEQPACKET, one message a datagram), then forks one process per
request, as vLLM forks its own workers after importing everything: each child runs the
request's script (`vllm_engine.py serve ...`) as `python SCRIPT ARGS` would, with the
request's environment, working directory and stdin, stdout and stderr (three descriptors
sent with it), and builds its engine, connector and KV cache itself, sharing nothing with
the others. The driver's side is `engines.Zygote`.

- request: {"argv": [SCRIPT, ARGS...], "env": {...}, "cwd": DIR, "netns": NAME or null}
  with three descriptors (NAME: the child enters that network namespace, as under
  `ip netns exec NAME`); reply {"pid": PID}
- when a child ends: {"exit": PID, "code": CODE} (a negative CODE is the signal that
  killed it, as `subprocess` says)
- the driver's end closed: this process ends (its children live on).

Nothing of kvpool is imported here: every child imports its own.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import selectors
import signal
import socket
import sys
from typing import Any, NoReturn

PRELOAD = ("vllm.v1.engine.core", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
           "vllm.model_executor.model_loader", "vllm.model_executor.models.llama")
"""Modules every engine's start imports, beside `vllm.LLM`'s own (what costs the time)."""


def enter_netns(name: str) -> None:
    """Into network namespace `name` (`ip netns add`'s, under /run/netns), as `ip netns exec`
    puts a command there (os.setns is Python 3.12's)."""
    import ctypes

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), f"setns into {name}")
    os.close(fd)


def child(argv: list[str], env: dict[str, str], cwd: str, netns: str | None,
          fds: list[int]) -> NoReturn:
    """In the forked process: the script, as `python SCRIPT ARGS` in that environment."""
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    if netns:
        enter_netns(netns)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    import tempfile

    tempfile.tempdir = None  # (the zygote's, which vLLM's imports asked for: this one's $TMPDIR)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as python puts a script's
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")  # the harness ends with os._exit
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(sock: socket.socket) -> None:
    woken_r, woken_w = os.pipe()
    os.set_blocking(woken_w, False)
    signal.set_wakeup_fd(woken_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(woken_r, selectors.EVENT_READ)

    def say(obj: dict[str, Any]) -> None:
        sock.send(json.dumps(obj).encode())

    while True:
        for key, _ in sel.select():
            if key.fileobj is woken_r:
                os.read(woken_r, 4096)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
            if not msg:
                return  # the driver is gone
            req = json.loads(msg)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                sel.close()
                sock.close()
                os.close(woken_r)
                os.close(woken_w)
                child(req["argv"], req["env"], req["cwd"], req.get("netns"), fds)
            for fd in fds:
                os.close(fd)
            say({"pid": pid})


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read by huggingface_hub at import
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import importlib

    import vllm

    vllm.LLM  # noqa: B018 (vLLM imports it on first use)
    for name in PRELOAD:
        importlib.import_module(name)
    # What was imported moves out of the collector's reach: every child's collections
    # would walk it (and copy its pages) again.
    gc.collect()
    gc.freeze()
    sock.send(b'{"ready": true}')
    serve(sock)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter tear-down of the frozen heap


if __name__ == "__main__":
    main()
