"""Micro-benchmarks (run as scripts, e.g. ``python benchmarks/algos.py --quick``)."""
