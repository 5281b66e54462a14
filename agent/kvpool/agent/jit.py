"""LLVM IR compiled for this CPU in this process (llvmlite's MCJIT): what the compiled loops
(`probekernel`, `wsumkernel`) share. Each kernel keeps its own IR and its fallback."""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_engines: list[Any] = []
"""The JIT engines owning the compiled code: they must live as long as the process."""
_compiles: list[threading.Thread] = []
"""Compiles started on threads of their own (`Lazy.compile_soon`), waited for as the
process exits (`_wait_for_compiles`)."""
EXIT_WAIT_SECONDS = 20.0
"""The longest an exiting process waits for its compiles under way (one takes well under
a second; a loaded machine may take a few)."""


def compile_ir(ir: str, names: Sequence[str], opt: int) -> list[int] | None:
    """The addresses of the functions `names` of `ir`, compiled at optimisation level `opt`
    for this machine's CPU; None without llvmlite. Raises what the JIT raises (an IR it
    refuses, no executable memory): the caller falls back to its Python path."""
    try:
        import llvmlite.binding as llvm
    except ImportError:
        return None
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    target = llvm.Target.from_default_triple()
    machine = target.create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(),
        opt=opt, jit=True)
    module = llvm.parse_assembly(ir)
    module.verify()
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    addresses = [engine.get_function_address(n) for n in names]
    _engines.append(engine)
    return addresses


class Lazy(Generic[T]):
    """Kernels compiled once per process, by the first caller that asks or on a thread of
    their own: `build` compiles them (None where it cannot, and is not tried again)."""

    def __init__(self, build: Callable[[], T | None], thread_name: str) -> None:
        self._build = build
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._value: T | None = None
        self._tried = False
        self._started = False

    def get(self) -> T | None:
        """The kernels, compiling them now if no one has yet; None without them."""
        if not self._tried:
            with self._lock:
                if not self._tried:
                    self._value = self._build()
                    self._tried = True
        return self._value

    def ready(self) -> T | None:
        """The kernels if compiled already, else None (never compiles: a caller on the
        event loop must not wait for a compile; `compile_soon` starts one)."""
        return self._value

    def compile_soon(self) -> None:
        """Compile on a thread of its own, once per process."""
        if not self._started:
            self._started = True
            thread = threading.Thread(target=self.get, name=self._thread_name, daemon=True)
            _compiles.append(thread)
            thread.start()


@atexit.register
def _wait_for_compiles() -> None:
    """The process exits only once its compiles are done. The compiling threads are
    daemons (a compile never holds up a stop by itself), but one still in LLVM as the
    interpreter exits runs on while LLVM's globals are destroyed under it: an agent stopped
    within a second of its start logged its clean stop, then aborted (SIGABRT, an LLVM
    assertion) or segfaulted, and so could a client's process (the lease-free reads'
    kernel) that exited right after it connected (tests/agent/test_jit_exit.py)."""
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    for thread in _compiles:
        thread.join(max(0.0, deadline - time.monotonic()))
