"""Benchmarks (offline throughput, online serving) and schedule pictures."""
