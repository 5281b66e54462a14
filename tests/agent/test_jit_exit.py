"""A process exits only once the kernels it compiles on threads of their own are done
(`kvpool.agent.jit`): a compiling thread still in LLVM as the interpreter exits met LLVM's
globals destroyed under it, and an agent stopped within a second of its start logged its
clean stop, then aborted (SIGABRT) or segfaulted."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

AGENT_SRC = str(Path(__file__).resolve().parents[2] / "agent")


def python(code: str, *args: str) -> subprocess.Popen[str]:
    """A Python process running `code` (with `args`) on this tree's agent sources."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                            env={**os.environ, "PYTHONPATH": AGENT_SRC},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


def test_the_exit_waits_for_a_compile_under_way(tmp_path: Path) -> None:
    # A build that takes half a second, started just before the main thread ends: the
    # process exits after it is done, not in its midst (its thread is a daemon's).
    done = tmp_path / "done"
    proc = python(f"""
        import time
        from kvpool.agent.jit import Lazy

        def build():
            time.sleep(0.5)
            open({str(done)!r}, "w").close()
            return 1

        Lazy(build, "test-jit").compile_soon()
        """)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert done.exists()


def test_processes_that_exit_while_the_real_kernels_compile_exit_cleanly() -> None:
    # Every kernel compiled on its thread, the process ending at a spread of moments
    # during the compiles (before: 2 of 20 such processes aborted or segfaulted).
    code = """
        import sys, time
        from kvpool.agent import leasekernel, lookupkernel, probekernel
        from kvpool.agent.peers import recvkernel, sendkernel
        for kernel in (recvkernel, sendkernel, probekernel, lookupkernel, leasekernel):
            kernel.compile_soon()
        time.sleep(float(sys.argv[1]))
        """
    procs = [python(code, str(delay)) for delay in (0.0, 0.05, 0.1, 0.15, 0.2, 0.3)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert err == ""
