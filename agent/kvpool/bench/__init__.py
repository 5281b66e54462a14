"""kvpool's tools: the demo, the benchmark suite, trace replay and the cache simulators.

No product module imports this package; only the `kvpool demo` and `kvpool bench` commands
load it, lazily.
"""
