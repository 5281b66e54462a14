"""LLVM IR compiled for this CPU in this process (llvmlite's MCJIT): what the compiled loops
(`probekernel`, `wsumkernel`) share. Each kernel keeps its own IR and its fallback."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_engines: list[Any] = []
"""The JIT engines owning the compiled code: they must live as long as the process."""


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
