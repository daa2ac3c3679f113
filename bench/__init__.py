"""Benchmarks: each prints medians and ratios measured side by side in one run (make bench)."""
