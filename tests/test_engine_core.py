"""The GPU-free engine core in virtual time: no I/O, the test is the clock."""

from __future__ import annotations

import random

import pytest

from perfmodel.profile import load_profile
from rounds.engine.kv_cache import KVCache, salt_hash
from rounds.engine.request import RemotePrefill, Request, RequestStatus
from rounds.engine.scheduler import Scheduler, SchedulerConfig, Step
from workers.sim.tokenizer import EOS_ID

pytestmark = pytest.mark.unit

PROFILE = load_profile("llama-3.1-8b_h100_tp1")


def make_request(rid: str, prompt: list[int], out: int = 4, max_tokens: int | None = None, **kw) -> Request:
    plan = [1000 + i for i in range(out - 1)] + [EOS_ID]
    return Request(rid, list(prompt), plan, max_tokens or out + 16, arrival_time=0.0, **kw)


def tokens(n: int, start: int = 300) -> list[int]:
    return list(range(start, start + n))


def run(scheduler: Scheduler, now: float = 0.0, max_steps: int = 10_000, check=None) -> tuple[float, list[Step]]:
    steps = []
    while scheduler.has_work and len(steps) < max_steps:
        step = scheduler.schedule(now)
        if step.empty:
            break
        now += step.duration
        scheduler.finish_step(step, now)
        steps.append(step)
        if check:
            check(scheduler, step)
    return now, steps


def assert_kv_consistent(scheduler: Scheduler, step: Step | None = None) -> None:
    kv = scheduler.kv
    referenced = [b for b, count in enumerate(kv.ref_cnt) if count > 0]
    assert len(referenced) + kv.num_free_blocks == kv.num_blocks
    assert all(kv.ref_cnt[b] == 0 for b in kv.free_queue())
    held = sum(len(h.block_ids) for h in scheduler.held.values())
    owned = sum(len(r.block_ids) for r in scheduler.running) + sum(len(r.block_ids) for r in scheduler.waiting)
    assert owned + held >= len(referenced)  # shared prefix blocks are owned by several requests
    for r in scheduler.running:
        assert len(r.block_ids) * kv.block_size >= r.num_computed_tokens
    if step is not None:
        assert step.num_tokens <= scheduler.config.max_num_batched_tokens


def test_single_request_runs_to_its_plan_and_frees_everything():
    s = Scheduler(PROFILE, SchedulerConfig(num_blocks=64))
    r = make_request("a", tokens(40), out=5)
    s.add_request(r)
    run(s, check=assert_kv_consistent)
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == r.output_plan
    assert s.kv.num_free_blocks == 64


def test_max_tokens_cuts_with_length():
    s = Scheduler(PROFILE, SchedulerConfig(num_blocks=64))
    r = make_request("a", tokens(10), out=10, max_tokens=3)
    s.add_request(r)
    run(s)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert len(r.output_token_ids) == 3


def test_step_times_equal_the_profile():
    s = Scheduler(PROFILE, SchedulerConfig(num_blocks=1024))
    a = make_request("a", tokens(700), out=3)
    s.add_request(a)
    first = s.schedule(0.0)
    assert first.duration == pytest.approx(PROFILE.t_pre(0, 700))
    s.finish_step(first, first.duration)
    second = s.schedule(first.duration)
    assert second.duration == pytest.approx(PROFILE.t_dec(1, 700))
    # A mixed step costs one forward pass over all its tokens.
    s.finish_step(second, 1.0)
    s.add_request(make_request("b", tokens(100, start=5000), out=3))
    mixed = s.schedule(1.0)
    assert [n for _, n in mixed.prefills] == [100] and mixed.decodes == [a]
    assert mixed.duration == pytest.approx(PROFILE.step_time(prefills=[(0, 100)], decode_contexts=[701]))


def test_running_requests_come_before_admissions_under_a_tight_budget():
    """vLLM 0.32's order (Scheduler.schedule): the running requests take their tokens first,
    a waiting prompt the rest of the budget, chunked."""
    s = Scheduler(PROFILE, SchedulerConfig(num_blocks=1024, max_num_batched_tokens=64))
    decoders = [make_request(f"d{i}", tokens(16, start=1000 * (i + 1)), out=50) for i in range(8)]
    for r in decoders:
        s.add_request(r)
    s.finish_step(s.schedule(0.0), 0.1)
    while any(not r.is_decoding for r in decoders):
        s.finish_step(s.schedule(0.2), 0.3)
    s.add_request(make_request("long", tokens(200, start=90_000), out=3))
    step = s.schedule(1.0)
    # Eight decodes first (one token each), then the new prompt: 64 - 8 = 56 of its tokens.
    assert [r.request_id for r in step.decodes] == [f"d{i}" for i in range(8)]
    assert [(r.request_id, n) for r, n in step.prefills] == [("long", 56)]
    s.finish_step(step, 1.1)
    # Now running, the long prompt's next chunk comes after the decodes admitted before it.
    step = s.schedule(1.1)
    assert len(step.decodes) == 8 and [(r.request_id, n) for r, n in step.prefills] == [("long", 56)]


def test_decodes_fill_what_prefill_leaves():
    s = Scheduler(PROFILE, SchedulerConfig(num_blocks=1024, max_num_batched_tokens=64))
    decoders = [make_request(f"d{i}", tokens(16, start=1000 * (i + 1)), out=50) for i in range(4)]
    for r in decoders:
        s.add_request(r)
    s.finish_step(s.schedule(0.0), 0.1)
    s.add_request(make_request("short", tokens(30, start=90_000), out=3))
    step = s.schedule(1.0)
    assert [(r.request_id, n) for r, n in step.prefills] == [("short", 30)]
    assert sorted(r.request_id for r in step.decodes) == ["d0", "d1", "d2", "d3"]


def test_chunked_prefill_respects_the_budget():
    budget = 512
    s = Scheduler(PROFILE, SchedulerConfig(num_blocks=1024, max_num_batched_tokens=budget))
    r = make_request("a", tokens(2000), out=2)
    s.add_request(r)
    _, steps = run(s, check=assert_kv_consistent)
    chunks = [n for step in steps for _, n in step.prefills]
    assert chunks == [512, 512, 512, 464]
    assert all(step.num_tokens <= budget for step in steps)
    # Each chunk is costed with the history computed so far.
    assert steps[1].duration == pytest.approx(PROFILE.t_pre(512, 512))


def test_prefix_hits_are_counted_and_skip_compute():
    s = Scheduler(PROFILE, SchedulerConfig(num_blocks=256, block_size=16))
    shared = tokens(64)
    a = make_request("a", shared + tokens(10, start=7000), out=2)
    s.add_request(a)
    run(s)
    b = make_request("b", shared + tokens(20, start=8000), out=2)
    s.add_request(b)
    step = s.schedule(10.0)
    assert b.num_cached_tokens == 64
    assert step.prefills == [(b, 20)]
    assert step.duration == pytest.approx(PROFILE.t_pre(64, 20))
    assert s.kv.stats.queries == 74 + 84
    assert s.kv.stats.hits == 64


def test_a_cache_salt_shares_blocks_only_between_requests_with_that_salt():
    s = Scheduler(PROFILE, SchedulerConfig(num_blocks=256, block_size=16))
    shared = tokens(64)
    s.add_request(make_request("a", shared + tokens(10, start=7000), out=2, cache_salt="tenant-a"))
    run(s)
    hits = {}
    for rid, salt in (("other", "tenant-b"), ("unsalted", None), ("same", "tenant-a")):
        request = make_request(rid, shared + tokens(20, start=8000), out=2, cache_salt=salt)
        s.add_request(request)
        s.schedule(10.0)
        hits[rid] = request.num_cached_tokens
        run(s, 10.0)
    assert hits == {"other": 0, "unsalted": 0, "same": 64}
    assert salt_hash(None) == 0 and salt_hash("x") == salt_hash("x") != salt_hash("y")


def test_a_fully_cached_prompt_still_computes_its_last_token():
    s = Scheduler(PROFILE, SchedulerConfig(num_blocks=64, block_size=16))
    prompt = tokens(32)
    s.add_request(make_request("a", prompt, out=2))
    run(s)
    again = make_request("b", prompt, out=2)
    s.add_request(again)
    step = s.schedule(1.0)
    assert again.num_cached_tokens == 16  # (32 - 1) // 16 full blocks may hit
    assert step.prefills == [(again, 16)]


def test_lru_evicts_a_requests_tail_before_its_prefix():
    kv = KVCache(num_blocks=4, block_size=2)
    blocks = kv.allocate(3)
    kv.cache_full_blocks(blocks, [11, 12, 13], 0, 3, tokens(6), None)
    kv.free(blocks)
    assert kv.free_queue() == [3, blocks[2], blocks[1], blocks[0]]
    kv.allocate(2)  # the never-used block, then the request's last block
    assert 13 not in kv.cached and 11 in kv.cached and 12 in kv.cached


def test_preemption_frees_blocks_and_everything_still_completes():
    cfg = SchedulerConfig(num_blocks=24, block_size=16, max_num_batched_tokens=2048)
    s = Scheduler(PROFILE, cfg)
    rng = random.Random(7)
    reqs = [
        make_request(f"r{i}", tokens(rng.randint(20, 90), start=10_000 * (i + 1)), out=rng.randint(20, 60))
        for i in range(12)
    ]
    for r in reqs:
        s.add_request(r)
    preempted_blocks_freed = []

    def check(sched: Scheduler, step: Step) -> None:
        assert_kv_consistent(sched, step)
        for victim in step.preempted:
            preempted_blocks_freed.append(victim.block_ids == [])

    run(s, check=check)
    assert s.num_preemptions > 0
    assert preempted_blocks_freed and all(preempted_blocks_freed)
    assert all(r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == r.output_plan for r in reqs)
    assert s.kv.num_free_blocks == cfg.num_blocks


def test_random_workload_never_overcommits():
    cfg = SchedulerConfig(num_blocks=40, block_size=16, max_num_batched_tokens=256, max_num_seqs=6)
    s = Scheduler(PROFILE, cfg)
    rng = random.Random(1)
    now, arrivals = 0.0, 0
    for _ in range(400):
        if arrivals < 60 and rng.random() < 0.4:
            base = rng.choice([0, 100_000, 200_000])  # shared prefixes
            prompt = tokens(48, start=base) + tokens(rng.randint(1, 120), start=300_000 + arrivals * 1000)
            s.add_request(make_request(f"q{arrivals}", prompt, out=rng.randint(2, 40)))
            arrivals += 1
        if rng.random() < 0.05 and s.running:
            s.abort(rng.choice(s.running).request_id)
        step = s.schedule(now)
        now += step.duration
        s.finish_step(step, now)
        assert_kv_consistent(s, step)
        assert len(s.running) <= cfg.max_num_seqs
    run(s, now, check=assert_kv_consistent)
    assert not s.running and not s.waiting
    assert s.kv.num_free_blocks == cfg.num_blocks


def test_prefill_side_holds_blocks_until_read_or_expiry():
    s = Scheduler(PROFILE, SchedulerConfig(num_blocks=32, block_size=16, transfer_hold_s=5.0))
    prompt = tokens(40)
    p = make_request("p", prompt, out=5, max_tokens=1, do_remote_decode=True)
    s.add_request(p)
    _, steps = run(s)
    assert p.status == RequestStatus.FINISHED_LENGTH
    held = s.held["p"].block_ids
    assert len(held) == 3 and s.kv.num_free_blocks == 29
    blocks = s.read_held("p", held[1:])
    assert blocks == [prompt[16:32], prompt[32:40]]
    assert s.read_held("p", [held[0], 999]) is None
    assert s.release_transfer("p") and s.kv.num_free_blocks == 32
    # Unread holds expire.
    q = make_request("q", tokens(40, start=5000), out=5, max_tokens=1, do_remote_decode=True)
    s.add_request(q)
    now, _ = run(s, now=100.0)
    s.schedule(now + 6.0)
    assert "q" not in s.held and s.num_expired_holds == 1 and s.kv.num_free_blocks == 32


def test_decode_side_pulls_only_the_blocks_it_lacks_and_recomputes_the_last_token():
    s = Scheduler(PROFILE, SchedulerConfig(num_blocks=64, block_size=16))
    history = tokens(48)
    s.add_request(make_request("round1", history + tokens(1, start=9000), out=2))
    run(s)  # 3 full blocks of history are now cached here
    prompt = history + tokens(30, start=9500)  # 78 tokens: 5 blocks
    remote = RemotePrefill("engine-p", "127.0.0.1", 1, "p-req", block_ids=(40, 41, 42, 43, 44))
    r = make_request("round2", prompt, out=3, remote_prefill=remote)
    s.add_request(r)
    step = s.schedule(1.0)
    assert step.empty and len(step.kv_loads) == 1
    load = step.kv_loads[0]
    assert load.remote_block_ids == [43, 44] and load.first_token == 48 and load.num_tokens == 30
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not s.has_work
    s.finish_kv_load("round2", ok=True)
    step = s.schedule(2.0)
    assert step.prefills == [(r, 1)]
    assert step.duration == pytest.approx(PROFILE.t_pre(77, 1))
    run(s, 2.0)
    assert r.output_token_ids == r.output_plan


def test_failed_remote_load_can_be_recomputed_locally():
    s = Scheduler(PROFILE, SchedulerConfig(num_blocks=64, block_size=16))
    remote = RemotePrefill("engine-p", "127.0.0.1", 1, "p-req", block_ids=(1, 2, 3))
    r = make_request("r", tokens(40), out=3, remote_prefill=remote)
    s.add_request(r)
    s.schedule(0.0)
    s.finish_kv_load("r", ok=False)
    step = s.schedule(1.0)
    assert step.prefills == [(r, 40)]
    run(s, 1.0, check=assert_kv_consistent)
    assert r.output_token_ids == r.output_plan and s.kv.num_free_blocks == 64


def test_a_request_handed_over_mid_decode_continues_from_the_kv_of_its_first_tokens():
    """DynaServe's split inside the decode phase, as vLLM's connector expresses it
    (tests/test_vllm_handoffs.py): alpha, a prefill request allowed d tokens, holds the KV
    of the prompt and its first d - 1 tokens; beta's prompt is the prompt plus alpha's d
    tokens, it pulls the held KV and computes only alpha's last token before it decodes on.
    The answer is the one plan, the held blocks hold exactly the tokens their KV is of."""
    config = SchedulerConfig(num_blocks=64, block_size=16)
    a, b = Scheduler(PROFILE, config), Scheduler(PROFILE, config)
    prompt, plan = tokens(40), [1000 + i for i in range(11)] + [EOS_ID]
    d = 5
    alpha = Request("alpha", prompt, plan, d, 0.0, do_remote_decode=True)
    a.add_request(alpha)
    run(a)
    assert alpha.status == RequestStatus.FINISHED_LENGTH and alpha.output_token_ids == plan[:d]
    held = a.held["alpha"].block_ids
    assert len(held) == 3 and alpha.num_computed_tokens == 40 + d - 1
    assert a.read_held("alpha", held) == [prompt[:16], prompt[16:32], [*prompt[32:], *plan[: d - 1]]]

    remote = RemotePrefill("engine-a", "127.0.0.1", 1, "alpha", tuple(held), num_tokens=alpha.num_computed_tokens)
    beta = Request("beta", prompt + plan[:d], plan[d:], len(plan) - d, 0.0, remote_prefill=remote)
    b.add_request(beta)
    step = b.schedule(1.0)
    (load,) = step.kv_loads
    assert load.remote_block_ids == held and (load.first_token, load.end_token) == (0, 40 + d - 1)
    b.finish_kv_load("beta", ok=True)
    a.release_transfer("alpha")
    step = b.schedule(2.0)
    assert step.prefills == [(beta, 1)]  # alpha's last token: its KV was never computed
    run(b, 2.0, check=assert_kv_consistent)
    assert alpha.output_token_ids + beta.output_token_ids == plan


def fused_decodes(blocks: int = 64) -> tuple[Scheduler, Step]:
    """Two requests decoding, fused into one step of up to 12 sub-steps."""
    s = Scheduler(PROFILE, SchedulerConfig(num_blocks=blocks, block_size=16))
    for i in range(2):
        s.add_request(make_request(f"d{i}", tokens(40, start=1000 * (i + 1)), out=30))
    now = 0.0
    while (step := s.schedule(now, max_decode_steps=12)).num_steps == 1:
        now += step.duration
        s.finish_step(step, now)
    return s, step


def test_requests_pulling_their_kv_join_a_fused_step_at_its_boundary_as_single_steps_would_have():
    """A request that only waits for its prompt's KV is admitted at the boundary of a fused
    decode step where a real engine would next schedule, and the step goes on: the batch is
    the same. Its blocks and pull, and every decode's tokens and blocks, are those of the
    step cut there and run on as single steps."""
    remote = RemotePrefill("engine-p", "127.0.0.1", 1, "p-req", block_ids=(40, 41, 42, 43))
    cut, fused = fused_decodes(), fused_decodes()
    elapsed = (fused[1].boundaries[2] + fused[1].boundaries[3]) / 2  # inside the fourth sub-step
    for s, _ in (cut, fused):
        s.add_request(make_request("r", tokens(60, start=7000), out=3, remote_prefill=remote))

    s, step = cut  # the reference: end the step at that boundary, then single steps
    s.cut(step, elapsed)
    at = step.duration
    s.finish_step(step, at)
    joined = s.schedule(at)
    loads, now = joined.kv_loads, at + joined.duration
    s.finish_step(joined, now)
    while s.running[0].num_output_tokens < fused[1].num_steps + 1:  # + the token before the fused step
        single = s.schedule(now)
        now += single.duration
        s.finish_step(single, now)

    s, step = fused
    pulls, goes_on = s.admit_during(step, elapsed, now=at)
    assert goes_on and len(step.boundaries) == 12
    assert [(p.local_block_ids, p.remote_block_ids, p.num_tokens) for p in pulls] == [
        (p.local_block_ids, p.remote_block_ids, p.num_tokens) for p in loads
    ]
    assert s.waiting[0].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s.finish_step(step, step.duration)
    assert step.duration == pytest.approx(now, rel=1e-12)
    for mine, theirs in zip(fused[0].running, cut[0].running, strict=True):
        assert (mine.output_token_ids, mine.block_ids) == (theirs.output_token_ids, theirs.block_ids)
    assert fused[0].kv.free_queue() == cut[0].kv.free_queue()
    assert_kv_consistent(fused[0])


def test_a_fused_step_ends_at_its_boundary_where_the_batch_would_change():
    s, step = fused_decodes()
    s.add_request(make_request("local", tokens(30, start=7000), out=3))  # to prefill here
    pulls, goes_on = s.admit_during(step, step.boundaries[4], now=1.0)
    assert (pulls, goes_on) == ([], False) and s.waiting[0].status == RequestStatus.WAITING

    s, step = fused_decodes()
    remote = RemotePrefill("engine-p", "127.0.0.1", 1, "p-req", block_ids=(40, 41))
    s.add_request(make_request("r", tokens(30, start=7000), out=3, remote_prefill=remote))
    pulls, goes_on = s.admit_during(step, step.boundaries[-1], now=1.0)  # the step ends there anyway
    assert (pulls, goes_on) == ([], False)

    # The pull is taken, but the decodes' later sub-steps no longer find their blocks:
    # the step ends at the boundary and the next schedule sorts it out.
    s, step = fused_decodes(blocks=14)
    free = s.kv.num_free_blocks
    remote = RemotePrefill("engine-p", "127.0.0.1", 1, "p-req", block_ids=tuple(range(40, 40 + free)))
    s.add_request(make_request("r", tokens(16 * free - 1, start=7000), out=3, remote_prefill=remote))
    pulls, goes_on = s.admit_during(step, step.boundaries[0], now=1.0)
    assert len(pulls) == 1 and not goes_on and s.kv.num_free_blocks == 0
