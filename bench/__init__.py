"""Benchmarks: the harness behind `ampd bench`, the studies' scripts, and their results."""
