"""The live gateway: the APIs, sessions, prefill queues and engines, driving the round core."""
