"""The coordinator: OpenAI API, sessions, routing, prefill queues, windowed statistics."""
