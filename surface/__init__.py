"""What engines and gateways share: vLLM's wire surface, the worker registry in Redis."""
