"""Benchmarks: each module prints figures and ratios measured in one run (not tests)."""
