"""The GPU-free engine: vLLM's HTTP surface over a simulated v1 engine core."""
