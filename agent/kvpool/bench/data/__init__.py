"""Data shipped with the package (the bundled workload trace)."""
