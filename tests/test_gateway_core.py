"""The gateway's pure scheduling core: Alg. 1, Eq. 1-2, Alg. 2, binding, policies, identity."""

from __future__ import annotations

import json
import random

import pytest

from gateway.state.sessions import (
    Session,
    canonical_message,
    continues,
    conversation_hashes,
    explicit_session_id,
)
from perfmodel.profile import load_profile, t_kv
from perfmodel.slo import ITL_RULES, SLO, Gaps
from rounds.binding import Arrivals, DecodeCandidate, choose_decode_worker
from rounds.conditional_disagg import ConditionalDisagg
from rounds.core import Bound, Candidate, Observation, RoundCore, RoundPlan, RoundResult, SessionState, Signals
from rounds.policies import POLICIES, pick, route
from rounds.reordering import QueuedTask, postponed_by, reorder, satisfied
from rounds.routing import (
    PrefillTask,
    Route,
    RouteContext,
    WorkerView,
    adaptive_route,
    local_cost,
    remote_cost,
    tail_aware_route,
)
from rounds.uncached_threshold import UncachedThreshold

pytestmark = pytest.mark.unit

D_PROFILE = load_profile("llama-3.1-70b_h20_tp4")
P_PROFILE = load_profile("llama-3.1-70b_h20_tp2")
SLO_ = SLO(ttft_s=5.0, itl_s=0.05)
TASK = PrefillTask("t1", l_hist=3000, l_total=3400, created_at=100.0)


def decode(**kw) -> WorkerView:
    return WorkerView("d", D_PROFILE, **kw)


def prefill(worker_id: str, **kw) -> WorkerView:
    return WorkerView(worker_id, P_PROFILE, **kw)


def ctx(d: WorkerView, prefills: list[WorkerView], seed: int = 0) -> RouteContext:
    return RouteContext(TASK, d, prefills, SLO_, alpha=0.9, beta=0.85, rng=random.Random(seed))


# -- Alg. 1 -------------------------------------------------------------------------


def test_alg1_takes_the_first_prefill_worker_with_ttft_slack_in_random_order():
    prefills = [prefill("p1", windowed_ttft=2.5), prefill("p2", windowed_ttft=4.25), prefill("p3", windowed_ttft=10.0)]
    seen = {adaptive_route(ctx(decode(), prefills, seed)).worker_id for seed in range(40)}
    assert seen == {"p1", "p2"}  # both have TTFT <= 4.5 s and cost the same; p3 never qualifies
    chosen = adaptive_route(ctx(decode(), prefills, 0))
    assert chosen.kind == "remote" and chosen.reason == "ttft-slack"
    assert chosen.estimate_s == pytest.approx(remote_cost(TASK, prefills[0], decode()))


def test_alg1_prefers_the_slack_worker_that_holds_the_session_prefix():
    """vLLM's protocol: any other prefill worker would recompute the 3,000-token history."""
    prefills = [prefill("p1", windowed_ttft=2.5), prefill("p2", windowed_ttft=4.25, cached_tokens=3000)]
    seen = {adaptive_route(ctx(decode(), prefills, seed)).worker_id for seed in range(20)}
    assert seen == {"p2"}


def test_alg1_workers_without_samples_count_as_idle():
    chosen = adaptive_route(ctx(decode(), [prefill("p1")], 0))
    assert (chosen.kind, chosen.reason) == ("remote", "ttft-slack")


def test_alg1_slack_needs_the_task_itself_to_fit_not_only_the_window():
    """A queue that built up since the window's rounds finished takes the slack away (no herding)."""
    queued = [prefill("p1", windowed_ttft=1.0, queue_cost=4.0)]  # Eq. 2 = 3.7 s + 4 s of queue > 4.5 s
    chosen = adaptive_route(ctx(decode(windowed_itl=0.01), queued, 0))
    assert (chosen.kind, chosen.reason) == ("local", "itl-slack")
    # ... and a long local queue takes d's slack away: the cheaper of the two wins on cost.
    busy = decode(windowed_itl=0.01, queue_cost=6.0)
    chosen = adaptive_route(ctx(busy, queued, 0))
    assert (chosen.kind, chosen.worker_id, chosen.reason) == ("local", "d", "cost")
    assert chosen.estimate_s == pytest.approx(local_cost(TASK, busy))


def test_alg1_goes_local_when_only_the_decode_worker_has_slack():
    prefills = [prefill("p1", windowed_ttft=4.75)]
    chosen = adaptive_route(ctx(decode(windowed_itl=0.0425), prefills, 0))
    assert (chosen.kind, chosen.worker_id, chosen.reason) == ("local", "d", "itl-slack")


def test_alg1_falls_back_to_the_cheapest_of_eq1_and_eq2():
    prefills = [prefill("p1", windowed_ttft=15.0, queue_cost=0.2), prefill("p2", windowed_ttft=15.0, queue_cost=5.0)]
    busy = decode(windowed_itl=0.2, queue_cost=0.0)
    chosen = adaptive_route(ctx(busy, prefills, 0))
    costs = {
        "d": local_cost(TASK, busy),
        "p1": remote_cost(TASK, prefills[0], busy),
        "p2": remote_cost(TASK, prefills[1], busy),
    }
    assert chosen.reason == "cost" and chosen.worker_id == min(costs, key=costs.get)
    assert chosen.estimate_s == pytest.approx(min(costs.values()))
    # With a long local queue the same task goes remote.
    swamped = decode(windowed_itl=0.2, queue_cost=30.0)
    assert adaptive_route(ctx(swamped, prefills, 0)).worker_id == "p1"


def test_eq1_by_hand():
    d = decode(queue_cost=0.3)
    expected = D_PROFILE.t_pre(3000, 400) + 0.3
    assert local_cost(TASK, d) == pytest.approx(expected)
    # Each piece, by hand: forward over 400 tokens, causal attention pairs, history read.
    p = D_PROFILE.pieces
    pairs = 400 * 3000 + 400 * 401 / 2
    assert D_PROFILE.t_pre(3000, 400) == pytest.approx(
        p.forward(400) + p.prefill_attention(pairs) + p.context_read(3000)
    )


def test_eq2_charges_what_vllm_really_moves():
    d = decode()
    cold = prefill("p", queue_cost=0.5)
    warm = prefill("p", queue_cost=0.5, cached_tokens=2900)
    # A prefill worker with nothing cached recomputes the whole history ...
    assert remote_cost(TASK, cold, d) == pytest.approx(P_PROFILE.t_pre(0, 3400) + t_kv(400, P_PROFILE, D_PROFILE) + 0.5)
    # ... one that served the session before only what it lacks; d pulls only the new 400 tokens.
    assert remote_cost(TASK, warm, d) == pytest.approx(
        P_PROFILE.t_pre(2900, 500) + t_kv(400, P_PROFILE, D_PROFILE) + 0.5
    )
    assert remote_cost(TASK, warm, d) < remote_cost(TASK, cold, d)


def test_costs_scale_with_worker_speed():
    fast = WorkerView("d", D_PROFILE, speed=20.0)
    assert local_cost(TASK, fast) == pytest.approx(local_cost(TASK, decode()) / 20)


def test_a_prefill_is_priced_as_its_engines_scheduler_corrected_the_profile():
    """An engine whose scheduler found its prefill steps take 1.8x the profile's price
    (perfmodel.step_correction, published in the registry) is priced so by the gateway:
    Eq. 1 and the compute of Eq. 2, not the KV transfer, and through the round core too."""
    slow = WorkerView("p1", P_PROFILE, prefill_factor=1.8)
    assert local_cost(TASK, decode(prefill_factor=1.8)) == pytest.approx(1.8 * local_cost(TASK, decode()))
    transfer = t_kv(TASK.l_incr, P_PROFILE, D_PROFILE)  # d pulls the increment
    plain = remote_cost(TASK, prefill("p1"), decode())
    assert remote_cost(TASK, slow, decode()) == pytest.approx(transfer + 1.8 * (plain - transfer))
    state = SessionState("d", l_hist=3000)
    corrected = Candidate("d", D_PROFILE, prefill_factor=1.8)
    local = RoundCore(POLICIES["coloc"]).plan(state, "t", 3400, 5.0, corrected, [], Signals({}, {}), SLO_)
    assert local.estimate_s == pytest.approx(1.8 * D_PROFILE.t_pre(3000, 400))


# -- Alg. 2 -------------------------------------------------------------------------


def queued(task_id: str, age: float, estimate: float, thres: float = 1.0, postponed: int = 0) -> QueuedTask:
    return QueuedTask(task_id, created_at=10.0 - age, estimate_s=estimate, ttft_thres_s=thres, postponed=postponed)


def test_eq4_counts_tasks_meeting_ttft():
    window = [queued("a", 0.0, 0.6), queued("b", 0.5, 0.3)]
    assert satisfied(window, (0, 1), now=10.0) == 1  # b finishes at 0.9 after 0.5 waiting: misses
    assert satisfied(window, (1, 0), now=10.0) == 2  # b at 0.3 (+0.5), a at 0.9


def test_alg2_reorders_to_save_the_urgent_task():
    window = [queued("a", 0.0, 0.6), queued("b", 0.5, 0.3), queued("c", 0.0, 0.05)]
    decision = reorder(window, now=10.0, cap=3)
    assert decision.satisfied == 3 and decision.order[0] in (1, 2)
    assert 0 in decision.postponed


def test_alg2_keeps_fifo_when_reordering_gains_nothing():
    window = [queued("a", 0.0, 0.1), queued("b", 0.0, 0.1), queued("c", 0.0, 0.1)]
    decision = reorder(window, now=10.0, cap=3)
    assert decision.order == (0, 1, 2) and decision.postponed == ()


def test_alg2_never_postpones_a_task_at_the_cap():
    window = [queued("a", 0.0, 0.6, postponed=3), queued("b", 0.5, 0.3), queued("c", 0.0, 0.05)]
    decision = reorder(window, now=10.0, cap=3)
    assert decision.order[0] == 0 and 0 not in decision.postponed


def test_postponement_means_being_overtaken():
    assert postponed_by((0, 1, 2)) == ()
    assert postponed_by((2, 0, 1)) == (0, 1)
    assert postponed_by((0, 2, 1)) == (1,)
    assert postponed_by((1, 0, 2)) == (0,)


def test_starvation_is_bounded_under_a_stream_of_urgent_tasks():
    """A slow task keeps getting overtaken by urgent newcomers, but at most w times."""
    w, now = 3, 0.0
    slow = QueuedTask("slow", created_at=0.0, estimate_s=0.9, ttft_thres_s=1.0)
    queue = [slow]
    served = []
    for i in range(10):
        queue.append(QueuedTask(f"u{i}", created_at=now, estimate_s=0.1, ttft_thres_s=0.15))
        window = queue[:w]
        decision = reorder(window, now, cap=w)
        for j in decision.postponed:
            t = window[j]
            queue[queue.index(t)] = QueuedTask(t.task_id, t.created_at, t.estimate_s, t.ttft_thres_s, t.postponed + 1)
        head = queue[decision.order[0]]
        served.append(head.task_id)
        queue.remove(head)
        now += head.estimate_s
    assert "slow" in served[: w + 1]


# -- policies and binding -----------------------------------------------------------


def test_policies_route_as_their_baselines_do():
    prefills = [prefill("p1", queue_cost=2.0), prefill("p2", queue_cost=0.1)]
    assert route(POLICIES["disagg"], ctx(decode(), prefills)).worker_id == "p2"
    assert route(POLICIES["coloc"], ctx(decode(), prefills)).kind == "local"
    assert route(POLICIES["continuum"], ctx(decode(), prefills)).kind == "local"
    assert route(POLICIES["ampd"], ctx(decode(), [])).kind == "local"  # no prefill workers


def test_queue_disciplines():
    window = [queued("a", 0.0, 0.6), queued("b", 0.5, 0.3), QueuedTask("c", 10.0, 0.05, 1.0, incremental=True)]
    assert pick(POLICIES["disagg"], window[:1], 10.0, 3).order == (0,)
    assert pick(POLICIES["continuum"], window, 10.0, 3).order[0] == 2
    assert pick(POLICIES["ampd"], window, 10.0, 3).satisfied == 3
    assert POLICIES["ampd"].window(3) == 3 and POLICIES["ampd-routing-only"].window(3) == 1


def test_binding_picks_the_lowest_expected_kv_usage():
    candidates = [DecodeCandidate("a", 0.30, 100_000), DecodeCandidate("b", 0.20, 100_000, arriving_tokens=20_000)]
    assert choose_decode_worker(candidates) == "a"  # b's scrape is stale: 0.2 + 0.2 expected
    assert choose_decode_worker([DecodeCandidate("a", 0.3, 10), DecodeCandidate("b", 0.1, 10)]) == "b"
    with pytest.raises(ValueError):
        choose_decode_worker([])


# -- today's production routers' rules, on cases from their documentation and code --------


def task(l_hist: int, l_total: int) -> PrefillTask:
    return PrefillTask("t", l_hist, l_total, 0.0)


def rule_ctx(t: PrefillTask, prefills: list[WorkerView] | None = None) -> RouteContext:
    return RouteContext(t, decode(), prefills or [prefill("p1"), prefill("p2", queue_cost=1.0)], SLO_)


@pytest.mark.parametrize(
    ("l_hist", "l_total", "kind"),
    [
        (3000, 3400, "local"),  # a tool round: 2,992 tokens cached in whole blocks, 408 new - both bounds hold
        (0, 1000, "remote"),  # a first round: short, but all of it new (ratio 1.0 >= 0.7)
        (7952, 10000, "remote"),  # 2,048 new tokens: not below eff_isl_threshold (strict)
        (7968, 10000, "local"),  # 2,032 new tokens
        (480, 1600, "remote"),  # 1,120 of 1,600 new: the ratio is exactly 0.7, not below it
        (496, 1600, "local"),  # 1,104 of 1,600: below
    ],
)
def test_dynamo_isl_bounding_bypasses_remote_prefill_below_both_bounds(l_hist, l_total, kind):
    chosen = ConditionalDisagg("isl_bounding")(rule_ctx(task(l_hist, l_total)))
    assert chosen.kind == kind
    assert chosen.reason == ("short-isl" if kind == "local" else "policy")
    if kind == "remote":  # the prefill worker its prefill router would pick: the cheapest by Eq. 2
        assert chosen.worker_id == "p1"


def test_dynamo_prefill_load_bypasses_when_the_chosen_prefill_worker_is_busy():
    """busy = active prefill tokens > prefill_busy_threshold x max_num_batched_tokens, on the
    worker the prefill router would pick; isl_or_load bypasses on either condition."""
    fresh = task(0, 1000)  # isl_bounding alone sends it remote
    at_capacity = [prefill("p1", active_tokens=8192), prefill("p2", queue_cost=1.0)]
    over = [prefill("p1", active_tokens=8193), prefill("p2", queue_cost=1.0, active_tokens=0)]
    assert ConditionalDisagg("prefill_load")(rule_ctx(fresh, at_capacity)).kind == "remote"  # not above: not busy
    chosen = ConditionalDisagg("prefill_load")(rule_ctx(fresh, over))
    assert (chosen.kind, chosen.reason) == ("local", "prefill-busy")  # p1 is the pick, and it is busy
    assert ConditionalDisagg("isl_or_load")(rule_ctx(fresh, over)).kind == "local"
    assert ConditionalDisagg("isl_or_load")(rule_ctx(task(3000, 3400), at_capacity)).reason == "short-isl"
    assert ConditionalDisagg("isl_or_load")(rule_ctx(fresh, at_capacity)).kind == "remote"


@pytest.mark.parametrize(
    ("l_hist", "l_total", "threshold", "kind"),
    [
        (3000, 3400, 256, "remote"),  # 408 uncached tokens
        (3000, 3248, 256, "remote"),  # exactly 256 uncached: llm-d disaggregates at the threshold
        (3000, 3247, 256, "local"),  # 255
        (0, 200, 256, "local"),  # a prompt below the threshold never goes remote
        (3000, 3400, 16, "remote"),  # llm-d's sample configuration
        (3000, 3400, 0, "local"),  # 0 disables disaggregation (llm-d v0.7+)
    ],
)
def test_uncached_threshold_disaggregates_at_or_above_the_threshold(l_hist, l_total, threshold, kind):
    chosen = UncachedThreshold(threshold)(rule_ctx(task(l_hist, l_total)))
    assert chosen.kind == kind and (kind == "remote" or chosen.reason == "cached-prefix")


def test_the_production_rules_see_queued_tokens_through_the_core():
    """The load a rule reads is what the prefill queues hold for each worker."""
    core = RoundCore(POLICIES["dynamo-conditional-load"])
    state = SessionState("d")
    busy = Signals({"p1": 0.0}, {}, active_tokens={"p1": 9000})
    quiet = Signals({"p1": 0.0}, {}, active_tokens={"p1": 100})
    assert core.plan(state, "t", 1000, 0.0, D_CANDIDATE, [P1], busy, SLO_).route.kind == "local"
    plan = core.plan(state, "t", 1000, 0.0, D_CANDIDATE, [P1], quiet, SLO_)
    assert plan.route.kind == "remote" and plan.tokens == 1000  # p1 computes the whole prompt


def test_ampd_tail_keeps_a_stalling_local_prefill_off_the_decode_worker_under_the_tail_rules():
    """d has ITL slack by its windowed mean, but prefilling 400 tokens there is one 0.3 s step:
    every stream decoding on d stalls that long, over the 50 ms ITL threshold."""
    idle = decode(windowed_itl=0.01)
    busy_prefills = [prefill("p1", windowed_ttft=15.0)]  # no TTFT slack anywhere: Alg. 1 goes on to d
    assert idle.longest_step(TASK.l_hist, TASK.l_incr) > 0.85 * SLO_.itl_s
    for rule in ("p95", "max"):
        ctx = RouteContext(TASK, idle, busy_prefills, SLO_, rng=random.Random(0), itl_rule=rule)
        chosen = tail_aware_route(ctx)
        assert (chosen.kind, chosen.reason) == ("remote", "stall")
        assert adaptive_route(ctx).kind == "local"  # Alg. 1 as published prefills it on d
    mean = RouteContext(TASK, idle, busy_prefills, SLO_, rng=random.Random(0), itl_rule="mean")
    assert tail_aware_route(mean) == adaptive_route(mean)
    # Chunked at 16 tokens a step, the same prefill's longest step fits: it stays local.
    chunked = RouteContext(TASK, decode(windowed_itl=0.01, prefill_chunk=16), busy_prefills, SLO_, itl_rule="max")
    assert chunked.decode.longest_step(TASK.l_hist, TASK.l_incr) <= 0.85 * SLO_.itl_s
    assert tail_aware_route(chunked).kind == "local"


# -- the round core: one home for what a round decides and records --------------------

D_CANDIDATE, P1, P2 = Candidate("d", D_PROFILE), Candidate("p1", P_PROFILE), Candidate("p2", P_PROFILE)
DECODERS = [DecodeCandidate("d", 0.5, 100_000), DecodeCandidate("e", 0.1, 100_000)]


def test_core_binds_new_sessions_by_memory_and_keeps_a_serving_worker():
    core = RoundCore(POLICIES["ampd"])
    fresh = core.bind(None, DECODERS)
    assert fresh.moved and fresh.state == SessionState("e")
    held = SessionState("d", l_hist=900, prefill_worker="p1", prefill_cached=800, rounds=2)
    assert core.bind(held, DECODERS) == Bound(held, moved=False)  # d still serves: it stays, though fuller
    rewritten = core.bind(held, DECODERS, keeps_history=False)  # the client rewrote its history
    assert not rewritten.moved and rewritten.state.l_hist == 0 and rewritten.state.decode_worker == "d"
    lost = core.bind(held, DECODERS[1:])  # d left: the session moves, and nothing of it is cached there
    assert lost.moved and lost.state == SessionState("e", 0, "p1", 800, 2)


def test_core_plan_routes_with_the_sessions_cache_and_estimates_what_the_queue_holds():
    core = RoundCore(POLICIES["disagg"], rng=random.Random(0))
    state = SessionState("d", l_hist=3000, prefill_worker="p2", prefill_cached=2900)
    signals = Signals({"p1": 0.0, "p2": 0.0}, {})
    plan = core.plan(state, "t", 3400, 5.0, D_CANDIDATE, [P1, P2, D_CANDIDATE], signals, SLO_)
    assert (plan.task.l_hist, plan.task.l_incr, plan.task.created_at) == (3000, 400, 5.0)
    assert plan.route.worker_id == "p2"  # it holds 2,900 tokens of the session: the cheapest by Eq. 2
    assert plan.estimate_s == pytest.approx(P_PROFILE.t_pre(2900, 500))  # compute only: no transfer, no queue
    local = RoundCore(POLICIES["coloc"]).plan(state, "t", 3400, 5.0, Candidate("d", D_PROFILE, speed=4.0),
                                              [P1], Signals({"d": 2.0}, {}), SLO_)  # fmt: skip
    assert local.route.kind == "local" and local.estimate_s == pytest.approx(D_PROFILE.t_pre(3000, 400) / 4.0)
    assert local.route.estimate_s == pytest.approx(local.estimate_s + 2.0)  # Eq. 1 adds d's queue


def test_core_close_says_what_the_round_changed():
    core = RoundCore(POLICIES["ampd"])
    state = SessionState("d", l_hist=3000, rounds=1)
    plan = RoundPlan(TASK, Route("remote", "p1", "ttft-slack", 1.2), 1.0, 3400)
    gaps = Gaps.of([0.04] * 9 + [0.14])  # one stall among ten gaps: mean 0.05, P95 and longest 0.14
    result = RoundResult("remote", "d", ttft_s=1.5, gaps=gaps, prompt_tokens=3400, completion_tokens=11,
                         queue_wait_s=0.2, prefill_s=1.1)  # fmt: skip
    closed = core.close("s1", state, plan, result, SLO_)
    assert closed.state == SessionState("d", l_hist=3411, prefill_worker="p1", prefill_cached=3400, rounds=2)
    assert closed.observations == (Observation("ttft", "p1", 1.5, 1), Observation("itl", "d", gaps.total_s, 10))
    record = closed.record
    assert (record.round, record.kind, record.route, record.prefill_worker, record.queued_on) == (
        2, "incremental", "remote", "p1", "p1")  # fmt: skip
    assert record.mean_itl_s == pytest.approx(0.05) and (record.l_hist, record.l_incr) == (3000, 400)
    assert (record.p95_itl_s, record.max_itl_s) == (0.14, 0.14)
    assert record.slo_met == {"mean": True, "p95": False, "max": False}  # the ITL SLO is 50 ms
    # The prefill worker failed and the round ran locally: its TTFT is the decode worker's, no cache moved.
    fallback = core.close("s1", state, plan, RoundResult("local", "d", None, Gaps(), 3400, 0), SLO_)
    assert fallback.state.prefill_worker == "" and fallback.observations == ()  # no token: nothing observed
    assert fallback.record.queued_on == "p1" and fallback.record.prefill_worker is None
    assert fallback.record.slo_met == dict.fromkeys(ITL_RULES, False)  # no token: it missed, whatever the rule


def test_itl_rules_read_a_rounds_gaps_as_documented():
    gaps = Gaps.of([0.01] * 19 + [0.5])  # 20 gaps: the 95th percentile by nearest rank is the 19th smallest
    assert gaps.by("mean") == pytest.approx(0.0345) and gaps.by("p95") == 0.01 and gaps.by("max") == 0.5
    assert Gaps.of([0.01] * 18 + [0.4, 0.5]).by("p95") == 0.4  # two stalls in twenty reach the P95
    slo = SLO(ttft_s=1.0, itl_s=0.05)
    assert slo.met(0.9, gaps.by("mean")) and slo.met(0.9, gaps.by("p95")) and not slo.met(0.9, gaps.by("max"))
    assert not slo.met(1.1, 0.0) and slo.met(1.0, None)  # TTFT at the threshold meets it; no gap: TTFT alone


def test_arrivals_count_until_a_scrape_that_began_after_landing():
    arrivals = Arrivals()
    arrivals.expect("d", 500)
    arrivals.expect("d", 300)
    arrivals.landed("d", 500)
    landed = arrivals.scrape_started()
    arrivals.landed("d", 300)  # landed while that scrape ran: it may not show it
    arrivals.scraped(landed)
    assert arrivals.tokens["d"] == 300
    arrivals.scraped(arrivals.scrape_started())
    assert arrivals.tokens["d"] == 0


# -- session identity -----------------------------------------------------------------


def test_explicit_session_id_precedence():
    body = {"prompt_cache_key": "pck", "user": "u", "metadata": {"session_id": "m"}}
    assert explicit_session_id({"x-session-id": "h"}, body) == "h"
    assert explicit_session_id({}, body) == "pck"
    assert explicit_session_id({}, {"user": "u", "metadata": {"session_id": "m"}}) == "u"
    assert explicit_session_id({}, {"metadata": {"session_id": "m"}}) == "m"
    assert explicit_session_id({}, {"messages": []}) is None


def test_canonical_messages_ignore_what_clients_reformat():
    a = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": '{"x": 1, "y": 2}'}}]}  # fmt: skip
    b = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "f",
         "arguments": '{"y":2,"x":1}'}}]}  # fmt: skip
    assert canonical_message(a) == canonical_message(b)
    assert canonical_message({"role": "user", "content": "hi "}) == canonical_message(
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    )
    assert canonical_message({"role": "user", "content": "hi"}) != canonical_message(
        {"role": "system", "content": "hi"}
    )


def test_hashes_are_chained_and_scoped():
    system = {"role": "system", "content": "You are helpful."}
    one_user = {"role": "user", "content": "a"}
    one = conversation_hashes("k1", [system, one_user])
    two = conversation_hashes("k1", [system, {"role": "user", "content": "b"}])
    assert one[0] == two[0] and one[1] != two[1]  # a shared system prompt is only a shared prefix
    assert conversation_hashes("k2", [system])[0] != one[0]  # another key never sees the same hashes
    reply = {"role": "assistant", "content": "c"}  # a conversation grown by a reply: one more hash
    assert conversation_hashes("k1", [reply], after=one[-1]) == conversation_hashes("k1", [system, one_user, reply])[2:]


def test_conversation_keys_keep_their_values():
    """Redis holds sessions under these hashes: a faster canonical form or a remembered
    link must give the very values the code before them gave (pinned from it), with
    non-ASCII text, content parts, tool calls and their arguments, and again from memory."""
    conversation = [
        {"role": "system", "content": "Tu es un agent. Réponds en français ☃"},
        {"role": "user", "content": [{"type": "text", "text": 'weather in "Paris"\n'}, {"type": "image_url"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"unit": "c", "city": "Paris", "days": [1, 2.5]}'},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "12°C, light rain\t"},
    ]
    pinned = ["487674dc5fef6ae4e9beee5a0c5a0350", "c98c71410c21accaa8bbbdfd9d37f3db",
              "b62bd28b5a2dbb920adbad91c18a0d31", "6538708c38caa51b5e1685e1aeb01c49"]  # fmt: skip
    assert conversation_hashes("key", conversation) == pinned
    assert conversation_hashes("key", conversation) == pinned  # every link remembered now
    assert conversation_hashes("key", [dict(reversed(m.items())) for m in conversation]) == pinned  # keys reordered
    odd = {"role": 5, "content": "x", "tool_call_id": None}  # not a chat message, still a stable hash
    assert canonical_message(odd) == json.dumps([5, "x", [], ""], sort_keys=True, separators=(",", ":"))


def test_continues_detects_rewritten_history():
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    hashes = conversation_hashes("s", messages)
    session = Session("id", "s", SessionState("d", l_hist=50), conversation_len=2, conversation_hash=hashes[-1])
    longer = conversation_hashes("s", messages + [{"role": "user", "content": "c"}])
    edited = conversation_hashes(
        "s", [{"role": "user", "content": "A"}, *messages[1:], {"role": "user", "content": "c"}]
    )
    assert continues(session, longer) and not continues(session, edited)


def test_a_step_target_is_written_where_an_engine_follows_one_and_holds_another():
    from gateway.engines.step_targets import to_assign

    followers = ("holds-it", "holds-other", "holds-none")  # an engine that follows none is not asked about
    held = {"holds-it": 42.5, "holds-other": 10.0, "own": 10.0}
    assert to_assign(dict.fromkeys(followers, 42.5), held) == {"holds-other": 42.5, "holds-none": 42.5}
    assert to_assign(dict.fromkeys(followers, 0.0), held) == {}  # a policy that sizes no steps leaves them be
