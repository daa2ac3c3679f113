"""Benchmarks (issue 4)."""
