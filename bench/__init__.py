"""Benchmarks and the GPU check, run from the repository root as ``python -m bench.<name>`` (docs/benchmarks.md)."""
