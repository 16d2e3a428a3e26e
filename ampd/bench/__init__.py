"""Benchmarks: one module per `ampd bench` command (registered in ampd.bench.commands)."""
