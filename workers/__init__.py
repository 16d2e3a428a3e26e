"""Inference engines: the GPU-free engine (sim) and the vLLM launcher."""
