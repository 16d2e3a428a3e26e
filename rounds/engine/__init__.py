"""An engine's step scheduler (vLLM v1's continuous batching, paged KV, chunked prefill). Pure: no I/O."""
