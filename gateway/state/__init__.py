"""The gateway's state in Redis, shared by its replicas: sessions, prefill queues, statistics."""
