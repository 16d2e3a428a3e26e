"""Discrete-event simulation of the whole system in virtual time (AMPD Appendix A.1).

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving"), Appendix A.1: the planner's simulator runs a
deployment - prefill and decode pools of given TP and DP - over a trace, with phase
splitting, KV transfer on the alpha-beta model and the runtime routing decision. Here
it is the live system's own code with the clock and the network taken out:

* every worker is a ``rounds.engine.scheduler.Scheduler`` (the GPU-free engine's core:
  continuous batching, chunked prefill, paged KV with prefix caching, preemption,
  NixlConnector-style holds and pulls), stepped in virtual time with fused decode steps;
* every round goes through the gateway's pure core: ``rounds.binding`` for new
  sessions, ``rounds.policies.route`` (Alg. 1) fed with windowed TTFT/ITL means and
  queued prefill seconds, and ``rounds.policies.pick`` (Alg. 2) at every dispatch
  from a worker's prefill queue with its slots - the decisions gateway.queues commits
  to Redis, here kept in memory;
* the hand-off is vLLM's: the prefill worker computes the whole prompt (less its own
  prefix-cache hits) and holds the blocks, the decode worker pulls the blocks it lacks
  (T_kv), recomputes the last prompt token and decodes; local rounds prefill the
  increment on the decode worker.

Differences from the live system, all deliberate: no network or gateway CPU time, KV
usage for binding is scraped every second as the gateway's pool does but without its
HTTP delay, and token ids are synthetic (unique per session, so prefix caching hits
exactly what the session's history is; the engine's block keys name the session and the
block's place instead of hashing its tokens, which hits and evicts alike:
``SimSession.block_hashes``).

Speed: the simulator is the planner's inner loop (``ampd bench simulate``); how an
engine looks at work that reaches it in the middle of a fused decode step is in
planner.simulator.engine_side. ``tests/test_sim_equality.py`` holds the results still
(to 1e-9) while this code changes.

The package, by part: ``config`` (the deployment run: ``Pool``, ``SimConfig``),
``state`` (the pieces of the live system that hold state, kept in memory), ``loop``
(``Simulation``: the workers set up and the discrete-event loop, and ``simulate``), the
sides that loop's events reach - ``gateway_side`` (a round bound, routed, queued,
dispatched and closed, and the pool's KV scrape), ``engine_side`` (the engines stepped
in virtual time, KV pulled between them) and ``elastic_control`` (the elastic
controller on the same events as live) - and ``report`` (what a run comes to).
"""

from planner.simulator.config import Pool, SimConfig
from planner.simulator.loop import Simulation, simulate
from planner.simulator.report import LatencySummary, RolesAt, SimReport, WorkerUsage

__all__ = ["LatencySummary", "Pool", "RolesAt", "SimConfig", "SimReport", "Simulation", "WorkerUsage", "simulate"]
