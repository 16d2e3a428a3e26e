"""Which engine a new session (or a remote prefill) goes to: by what each engine's prefix
cache holds of the prompt and how loaded it is. Pure: no I/O.

One switch, ``--placement``, beside ``--policy``. Every rule takes one
:class:`PlacementContext` - the prompt, and per engine the tokens of it that engine
caches (as an index fed by the engines' KV events reports them) and its load - and
returns a worker id, as llm-d's scheduling plugins take one request and score endpoints:

* ``memory``: the engine with the most free KV, AMPD's binding as published
  (rounds.binding.choose_decode_worker; the engines' caches are not consulted);
* ``ampd``: AMPD's own cost with the true cached prefix - Eq. 1's t_pre(l_hist, l_incr)
  plus the engine's queue, with l_hist the tokens that engine caches - beside the
  engine's KV use (:func:`ampd`);
* ``dynamo-kv``: Dynamo's KV router cost (:func:`dynamo_kv`);
* ``llmd-prefix``: llm-d's precise prefix-cache scorer with its queue and KV-utilisation
  scorers and the max-score picker (:func:`llmd_prefix`);
* ``sglang-cache``: SGLang's cache-aware router (:func:`sglang_cache`).

The three production rules are written from their own code and documentation, cited at
each; none of their code is copied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

Placement = Literal["memory", "ampd", "dynamo-kv", "llmd-prefix", "sglang-cache"]
PLACEMENTS: tuple[Placement, ...] = get_args(Placement)
Pool = Literal["decode", "prefill"]

# ``ampd``'s weight on an engine's KV use beside its Eq. 1 estimate (relative to the
# costliest engine's): Eq. 1 prices the round's prefill, not the decoding the session then
# adds to the engine, so without it every session of one agent type would pile onto the
# engine that cached its prompt. Chosen among 0.25-2 on the placement bench's traces.
KV_WEIGHT = 0.5

# Dynamo's default ``--kv-overlap-score-weight`` (ai-dynamo/dynamo docs/router/README.md,
# "Cost Function"; lib/llm/src/kv_router/scheduler.rs, DefaultWorkerSelector::select_worker).
DYNAMO_OVERLAP_WEIGHT = 1.0

# llm-d's precise prefix-cache profile (llm-d/llm-d guides/precise-prefix-cache-aware,
# the EndpointPickerConfig of its gaie-kv-events values): precise-prefix-cache-scorer 3,
# queue-scorer 2, kv-cache-utilization-scorer 2, max-score-picker.
LLMD_PREFIX_WEIGHT, LLMD_QUEUE_WEIGHT, LLMD_KV_WEIGHT = 3.0, 2.0, 2.0

# SGLang's router as users launch it (the defaults of ``--cache-threshold``,
# ``--balance-abs-threshold`` and ``--balance-rel-threshold`` in sglang-router's and smg's
# launchers: sglang_router/router_args.py, RouterArgs, in sglang-router 0.3.2; the Rust
# CacheAwareConfig::default is 0.5, 32 and 1.0001): the least match ratio to follow the
# cache, and the load gap (absolute, in requests, and relative) past which it balances
# load instead.
SGLANG_CACHE_THRESHOLD = 0.3
SGLANG_BALANCE_ABS = 64
SGLANG_BALANCE_REL = 1.5


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine as placement sees it when a prompt is to be placed."""

    worker_id: str
    cached_tokens: int = 0  # the prompt's leading tokens its prefix cache holds (whole blocks)
    prefill_tokens: int = 0  # prompt tokens it has to compute for prefills queued or running on it
    waiting: int = 0  # requests queued on it, not started
    running: int = 0  # requests in flight on it: queued, prefilling or decoding
    kv_usage: float = 0.0  # fraction of its KV in use, with what is bound and on its way (rounds.binding)
    kv_capacity_tokens: int = 0
    estimate_s: float = 0.0  # Eq. 1 of the prompt on it with l_hist = cached_tokens, its queue included


@dataclass(frozen=True)
class PlacementContext:
    """Everything a placement rule may look at for one prompt."""

    pool: Pool  # binding a session's decode engine, or choosing a remote prefill's engine
    prompt_tokens: int
    block_size: int
    engines: Sequence[EngineLoad]
    # Prompts prefill on engines of their own (prefill/decode disaggregation), so a decode
    # engine's cache is not what a session's prompts are computed against; False where the
    # engine a session is bound to prefills its rounds.
    disaggregated: bool = False

    def new_tokens(self, engine: EngineLoad) -> int:
        """The prompt tokens ``engine`` would compute: those its cache lacks."""
        return max(0, self.prompt_tokens - engine.cached_tokens)

    def blocks(self, tokens: float) -> float:
        return tokens / self.block_size


def memory(ctx: PlacementContext) -> str:
    """The engine with the least KV in use (AMPD section 3, rounds.binding)."""
    return min(ctx.engines, key=lambda e: (e.kv_usage, e.worker_id)).worker_id


def ampd(ctx: PlacementContext) -> str:
    """The least of AMPD's Eq. 1 with l_hist the engine's true cached prefix, its queue
    included, taken relative to the costliest engine's, plus :data:`KV_WEIGHT` times the
    engine's KV use - the decode load and the room for later rounds that the session
    joins there, which Eq. 1 does not price - among the engines the prompt's uncached
    tokens fit in (all, where none has room). A remote prefill's engine is not placed
    here: Alg. 1 itself takes the cheapest by Eq. 2 over every prefill engine, each with
    its true cached prefix (rounds.core.RoundCore.plan)."""
    roomy = [e for e in ctx.engines if e.kv_usage * e.kv_capacity_tokens + ctx.new_tokens(e) <= e.kv_capacity_tokens]
    costliest = max(e.estimate_s for e in ctx.engines) or 1.0

    def cost(e: EngineLoad) -> float:
        return e.estimate_s / costliest + KV_WEIGHT * e.kv_usage

    return min(roomy or ctx.engines, key=lambda e: (cost(e), e.kv_usage, e.worker_id)).worker_id


def dynamo_kv(ctx: PlacementContext) -> str:
    """Dynamo's KV router: the least ``overlap_weight * potential_prefill_blocks +
    potential_active_blocks`` (ai-dynamo/dynamo lib/llm/src/kv_router/scheduler.rs,
    DefaultWorkerSelector::select_worker; docs/router/README.md "Cost Function"). The
    prefill blocks are those the engine has queued or running plus the prompt's uncached
    ones; the active blocks are the KV blocks it holds plus the ones the prompt adds.
    At the default temperature 0 it takes the least cost; ties go by worker id here."""

    def logit(e: EngineLoad) -> float:
        new = ctx.new_tokens(e)
        prefill_blocks = ctx.blocks(e.prefill_tokens + new)
        active_blocks = ctx.blocks(e.kv_usage * e.kv_capacity_tokens) + -(-new // ctx.block_size)
        return DYNAMO_OVERLAP_WEIGHT * prefill_blocks + active_blocks

    return min(ctx.engines, key=lambda e: (logit(e), e.worker_id)).worker_id


def _min_max(values: dict[str, float], higher_is_better: bool) -> dict[str, float]:
    """Scores scaled to 0..1 over the engines, 1 for all when they are equal (as
    gateway-api-inference-extension's scorers and llm-d's indexedScoresToNormalizedScoredPods do)."""
    low, high = min(values.values()), max(values.values())
    if high == low:
        return dict.fromkeys(values, 1.0)
    span = high - low
    return {k: (v - low) / span if higher_is_better else (high - v) / span for k, v in values.items()}


def llmd_prefix(ctx: PlacementContext) -> str:
    """llm-d's precise prefix-cache profile: the highest weighted sum of

    * the precise-prefix-cache-scorer: the cached blocks the KV-event index reports,
      min-max scaled over the engines that hold any (engines with none score 0;
      llm-d/llm-d-inference-scheduler pkg/plugins/scorer/precise_prefix_cache.go,
      indexedScoresToNormalizedScoredPods);
    * the queue-scorer: fewer waiting requests, min-max scaled (gateway-api-inference-extension
      pkg/epp/scheduling/framework/plugins/scorer/queue.go);
    * the kv-cache-utilization-scorer: 1 - KV use (the same repository, kvcache_utilization.go);

    picked by the max-score-picker (ties go by worker id here; it shuffles them)."""
    hits = {e.worker_id: float(e.cached_tokens // ctx.block_size) for e in ctx.engines if e.cached_tokens}
    prefix = _min_max(hits, higher_is_better=True) if hits else {}
    queue = _min_max({e.worker_id: float(e.waiting) for e in ctx.engines}, higher_is_better=False)

    def score(e: EngineLoad) -> float:
        return (LLMD_PREFIX_WEIGHT * prefix.get(e.worker_id, 0.0) + LLMD_QUEUE_WEIGHT * queue[e.worker_id]
                + LLMD_KV_WEIGHT * (1.0 - e.kv_usage))  # fmt: skip

    return min(ctx.engines, key=lambda e: (-score(e), e.worker_id)).worker_id


def sglang_cache(ctx: PlacementContext) -> str:
    """SGLang's cache-aware router (sgl-project/sglang sgl-router/src/policies/cache_aware.rs,
    CacheAwarePolicy::select_worker_with_headers and select_worker_pair_with_headers).
    Load is requests in flight. When load is imbalanced - max - min above
    ``balance_abs_threshold`` and max above ``balance_rel_threshold`` times min - the least
    loaded; else the engine with the longest cached match if it covers more than
    ``cache_threshold`` of the prompt, else the least loaded. Under prefill/decode
    disaggregation it places prefills so, and decodes by load alone; where the engines
    prefill what they decode, a session's engine is placed by its cache too."""
    least_loaded = min(ctx.engines, key=lambda e: (e.running, e.worker_id)).worker_id
    if ctx.pool == "decode" and ctx.disaggregated:
        return least_loaded
    loads = [e.running for e in ctx.engines]
    if max(loads) - min(loads) > SGLANG_BALANCE_ABS and max(loads) > SGLANG_BALANCE_REL * min(loads):
        return least_loaded
    best = min(ctx.engines, key=lambda e: (-e.cached_tokens, e.worker_id))
    if best.cached_tokens > SGLANG_CACHE_THRESHOLD * ctx.prompt_tokens:
        return best.worker_id
    return least_loaded


RULES: dict[Placement, Callable[[PlacementContext], str]] = {
    "memory": memory,
    "ampd": ampd,
    "dynamo-kv": dynamo_kv,
    "llmd-prefix": llmd_prefix,
    "sglang-cache": sglang_cache,
}


def place(placement: Placement, ctx: PlacementContext) -> str:
    """The engine ``placement`` picks for ``ctx``'s prompt."""
    if not ctx.engines:
        raise ValueError("no engine to place on")
    return RULES[placement](ctx)
