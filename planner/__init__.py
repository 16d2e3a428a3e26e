"""Offline side of ampd: the performance model, profiler, simulator and deployment planner."""
