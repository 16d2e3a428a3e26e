"""Split requests (DynaServe's micro-requests): the split point, the engines' two halves and
the gateway's ``dynaserve`` policy end to end.

The pure part decides hand-made cases of Alg. 1 and the SLO-aware step sizing; the live
part runs real GPU-free engines (the hand-off's KV moves as block contents checked
against the prompt) and gateways in subprocesses over real Redis, through the OpenAI SDK.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import uuid

import openai
import pytest
import redis

from bench.split import ARMS
from perfmodel.profile import load_profile
from perfmodel.slo import SLO
from rounds.engine.request import RemotePrefill, Request
from rounds.engine.scheduler import Scheduler, SchedulerConfig
from rounds.routing import PrefillTask, RouteContext, WorkerView
from rounds.split_point import (
    alg1_route,
    alpha_time,
    balance_point,
    beta_time,
    finish_time,
    handoff_point,
    recompute_time,
    split_route,
)
from surface.wire import prefill_params
from tests.engines import Engine, session_rounds, start_gateway, start_sim_worker, stop
from tests.test_engine_protocol import chat

REDIS_URL = "redis://127.0.0.1:6379/13"  # the suite's own database
PROFILE = load_profile("llama-3.1-70b_h20_tp4")
SLO_ = SLO(ttft_s=5.0, itl_s=0.05)
BLOCK = 16


def context(l_hist: int, l_total: int, d_queue: float = 0.0, p_queue: float = 0.0, **p) -> RouteContext:
    task = PrefillTask("t", l_hist, l_total, 0.0)
    decode = WorkerView("d", PROFILE, queue_cost=d_queue)
    return RouteContext(task, decode, [WorkerView("p", PROFILE, queue_cost=p_queue, **p)], SLO_, rng=random.Random(0))


# -- Alg. 1: the split point ---------------------------------------------------------------------


@pytest.mark.unit
def test_alg1_shares_a_first_prompt_between_idle_engines_at_the_balance_in_whole_blocks():
    ctx = context(0, 6000)
    s = balance_point(ctx, ctx.prefills[0])
    assert 0 < s < 6000 and s % BLOCK == 0
    # Within the search's resolution (6 halvings of the prompt) of the balance: moving the
    # point by that much tips the balance the other way on one side.
    step = 6000 // 2**6 + BLOCK
    t1, t2 = alpha_time(ctx, ctx.prefills[0], s), beta_time(ctx, s)
    assert (alpha_time(ctx, ctx.prefills[0], s + step) > beta_time(ctx, s + step)) or t1 > t2
    assert (alpha_time(ctx, ctx.prefills[0], s - step) < beta_time(ctx, s - step)) or t1 < t2
    assert alg1_route(ctx).split_at == s


@pytest.mark.unit
def test_dynaserve_splits_only_where_the_split_finishes_the_prompt_first():
    """Beta waits for alpha's KV: on idle engines a split finishes after the better end, so
    none is made; with the decode engine's queue half a remote prefill long, the split
    whose hand-off lands as the queue drains beats both ends."""
    idle = context(0, 6000)
    assert split_route(idle).split_at is None
    prefill = idle.prefills[0]
    queue = alpha_time(idle, prefill, 6000) / 2
    busy = context(0, 6000, d_queue=queue)
    s = handoff_point(busy, prefill)
    assert 0 < s < 6000 and s % BLOCK == 0
    assert alpha_time(busy, prefill, s) <= queue < alpha_time(busy, prefill, s + BLOCK)
    ends = min(finish_time(busy, prefill, 0), finish_time(busy, prefill, 6000))
    assert finish_time(busy, prefill, s) < ends
    chosen = split_route(busy)
    assert (chosen.kind, chosen.worker_id, chosen.split_at) == ("remote", "p", s)


@pytest.mark.unit
def test_a_loaded_prefill_engine_leaves_the_round_local_and_a_loaded_decode_engine_sends_it_whole():
    for rule in (split_route, alg1_route):
        busy_prefill = context(3000, 3400, p_queue=10.0)
        assert rule(busy_prefill).kind == "local"
        busy_decode = context(3000, 3400, d_queue=10.0, cached_tokens=3000)
        chosen = rule(busy_decode)
        assert (chosen.kind, chosen.split_at) == ("remote", None)


@pytest.mark.unit
def test_dynaserve_charges_a_remote_prefill_the_history_it_recomputes():
    """A prefill engine without the session's history recomputes it: work no engine would do
    were the round local, which at saturation delays the rounds queued behind it. The round
    goes remote only where it finishes sooner by more than that work, split or whole."""
    warm = context(3000, 3400, d_queue=3.0, cached_tokens=3000)
    assert recompute_time(warm, warm.prefills[0], 3400) == 0.0
    assert split_route(warm).kind == "remote"
    cold = context(3000, 3400, d_queue=3.0)
    prefill = cold.prefills[0]
    recompute = recompute_time(cold, prefill, 3400)
    assert recompute > 0.5 and recompute_time(cold, prefill, 3000) == 0.0
    assert recompute_time(cold, prefill, 3200) == pytest.approx(recompute, rel=0.01)  # a split recomputes it too
    # Sent whole it would finish first, but not by the history's recompute: it stays local.
    whole, local = finish_time(cold, prefill, 3400), finish_time(cold, prefill, 3000)
    assert whole < local < whole + recompute
    assert split_route(cold).kind == "local" and split_route(context(3000, 3400, d_queue=30.0)).kind == "local"
    # A short history under a long increment is worth recomputing to skip the queue.
    short = context(400, 3400, d_queue=3.0)
    assert 0.0 < recompute_time(short, short.prefills[0], 3400) < finish_time(short, short.prefills[0], 400) - 3.0
    assert split_route(short).kind == "remote"


@pytest.mark.unit
def test_engines_that_cannot_split_get_one_end_or_the_other():
    for queue in (0.0, 0.3, 3.0):
        ctx = context(0, 6000, d_queue=queue, splits=False)
        assert split_route(ctx).split_at is None and alg1_route(ctx).split_at is None


@pytest.mark.unit
def test_a_prefill_engine_holding_the_history_takes_part_of_the_increment():
    cold = context(4000, 6000)
    warm = context(4000, 6000, cached_tokens=4000)
    s_cold, s_warm = balance_point(cold, cold.prefills[0]), balance_point(warm, warm.prefills[0])
    assert s_warm > 4000 and s_warm >= s_cold  # no history to recompute: more of the increment fits
    queue = alpha_time(warm, warm.prefills[0], 6000) / 2  # the same for the hand-off point
    cold, warm = context(4000, 6000, d_queue=queue), context(4000, 6000, d_queue=queue, cached_tokens=4000)
    assert handoff_point(warm, warm.prefills[0]) > max(4000, handoff_point(cold, cold.prefills[0]))


# -- the engine's halves -------------------------------------------------------------------------


@pytest.mark.unit
def test_a_split_request_pulls_its_first_part_and_prefills_the_rest():
    scheduler = Scheduler(PROFILE, SchedulerConfig(num_blocks=200))
    prompt = list(range(1000))
    remote = RemotePrefill("p", "", 0, "r", tuple(range(25)), num_tokens=400)
    scheduler.add_request(Request("x", prompt, [7, 8, 9], 3, 0.0, remote_prefill=remote))
    step = scheduler.schedule(0.0)
    (load,) = step.kv_loads
    assert (load.first_token, load.end_token, load.num_tokens, len(load.remote_block_ids)) == (0, 400, 400, 25)
    scheduler.finish_kv_load("x", ok=True)
    step = scheduler.schedule(1.0)
    assert [(r.request_id, n) for r, n in step.prefills] == [("x", 600)]  # the rest, computed here


@pytest.mark.unit
def test_a_step_target_sizes_prefills_around_the_decodes():
    target = 0.05
    scheduler = Scheduler(PROFILE, SchedulerConfig(num_blocks=2000, step_target_s=target))
    for i in range(8):  # eight streams decoding
        scheduler.add_request(Request(f"d{i}", list(range(i * 1000, i * 1000 + 500)), [1] * 50, 50, 0.0))
    scheduler.finish_step(scheduler.schedule(0.0), 0.0)
    scheduler.add_request(Request("long", list(range(90_000, 98_000)), [1], 1, 0.0))
    step = scheduler.schedule(1.0)
    (chunk,) = [n for r, n in step.prefills if r.request_id == "long"]
    assert 0 < chunk < 8000 and len(step.decodes) == 8
    assert step.duration <= target
    free = Scheduler(PROFILE, SchedulerConfig(num_blocks=2000))
    free.add_request(Request("long", list(range(90_000, 98_000)), [1], 1, 0.0))
    assert free.schedule(0.0).prefills[0][1] == 8000  # no target: the whole budget


# -- live: engines and the gateway -----------------------------------------------------------------


class Stack:
    """Two GPU-free engines (``both``), a gateway splitting rounds and one colocating them."""

    def __init__(self, tmp) -> None:
        self.prefix = f"split-{uuid.uuid4().hex[:8]}"
        self.redis = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        common = ("--role", "both", "--redis-url", REDIS_URL, "--redis-prefix", self.prefix, "--speed", "20")
        self.engines: list[Engine] = []
        self.gateways = {}
        try:
            for _ in range(2):
                self.engines.append(start_sim_worker(tmp, *common))
            for policy in ("dynaserve", "dynaserve-alg1", "coloc"):
                self.gateways[policy] = start_gateway(tmp, REDIS_URL, self.prefix, "--policy", policy)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for child in self.gateways.values():
            child.stop()
        for engine in self.engines:
            stop(engine)
        keys = list(self.redis.scan_iter(match=f"{self.prefix}:*", count=1000))
        if keys:
            self.redis.delete(*keys)

    def rounds(self, policy: str, session_id: str, count: int) -> list[dict]:
        return session_rounds(self.gateways[policy].url, session_id, count)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("split"))
    yield s
    s.close()


def long_text(words: int) -> str:
    return f"Case {uuid.uuid4().hex}. " + " ".join(f"fact{i % 97} holds" for i in range(words))


def test_the_engines_run_a_split_prompt_and_say_what_an_unsplit_one_says(stack):
    first, second = stack.engines
    pulled = "vllm:nixl_bytes_transferred_sum"

    def handed_off(messages: list[dict], split_at: int | None) -> tuple[dict, dict, float]:
        """Prefill on ``first`` (all of the prompt, or its first ``split_at`` tokens), decode on
        ``second``: the params, the reply and the bytes ``second`` pulled."""
        prefill = chat(first, messages=messages, max_tokens=1, kv_transfer_params=prefill_params(split_at))
        assert prefill.status_code == 200, prefill.text
        params = prefill.json()["kv_transfer_params"]
        before = second.metrics()
        reply = chat(second, messages=messages, max_tokens=24, seed=11, kv_transfer_params=params)
        assert reply.status_code == 200, reply.text
        after = second.metrics_once(lambda m: m[pulled] > before[pulled])
        assert after["vllm:nixl_num_failed_transfers_total"] == before["vllm:nixl_num_failed_transfers_total"]
        return params, reply.json(), after[pulled] - before[pulled]

    # A whole hand-off of a fresh prompt gives the bytes of one block.
    whole, _, whole_bytes = handed_off([{"role": "user", "content": long_text(300)}], None)
    block_bytes = whole_bytes / len(whole["remote_block_ids"][0])

    messages = [{"role": "user", "content": long_text(400)}]  # nothing of it cached anywhere
    alone = chat(first, messages=messages, max_tokens=24, seed=11).json()
    params, split, split_bytes = handed_off(messages, 256)
    assert params["remote_num_tokens"] == 256 and len(params["remote_block_ids"][0]) == 256 // BLOCK
    assert split_bytes == 256 // BLOCK * block_bytes  # the first part came over; the rest was computed
    assert split["choices"][0]["message"] == alone["choices"][0]["message"]
    assert split["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"] > 256


def test_a_split_point_off_the_block_grid_is_refused_in_vllms_shape(stack):
    response = chat(stack.engines[0], messages=[{"role": "user", "content": long_text(100)}], max_tokens=1,
                    kv_transfer_params=prefill_params(100))  # fmt: skip
    assert response.status_code == 400
    error = response.json()["error"]
    assert "split_at" in error["message"] and error["type"] == "BadRequestError"


@pytest.mark.parametrize("stream", [True, False])
def test_split_rounds_say_what_colocation_says(stack, stream):
    """A three-round session through each splitting gateway, then the same conversation
    through the colocating one: the same words every round, every round recorded, and
    rounds split by Alg. 1 (on idle engines ``dynaserve``'s own rule mostly does not)."""
    said: dict[str, list[str]] = {"dynaserve": [], "dynaserve-alg1": [], "coloc": []}
    conversation = [{"role": "user", "content": long_text(500)}]
    extras = [long_text(300), long_text(200)]
    sessions = {policy: f"split-{policy}-{uuid.uuid4().hex[:8]}" for policy in said}
    for policy in said:
        client = openai.OpenAI(base_url=f"{stack.gateways[policy].url}/v1", api_key="none", max_retries=0)
        messages = list(conversation)
        for turn in range(3):
            kw = dict(model=stack.engines[0].model, messages=messages, max_tokens=20, seed=5 + turn,
                      extra_headers={"X-Session-Id": sessions[policy]})  # fmt: skip
            if stream:
                text = "".join(
                    chunk.choices[0].delta.content or ""
                    for chunk in client.chat.completions.create(stream=True, **kw)
                    if chunk.choices
                )
            else:
                text = client.chat.completions.create(**kw).choices[0].message.content
            said[policy].append(text)
            messages = [*messages, {"role": "assistant", "content": text}]
            if turn < 2:
                messages.append({"role": "user", "content": extras[turn]})
    assert said["dynaserve"] == said["dynaserve-alg1"] == said["coloc"] and all(said["coloc"])
    assert [r["round"] for r in stack.rounds("dynaserve", sessions["dynaserve"], 3)] == [1, 2, 3]
    split_rounds = stack.rounds("dynaserve-alg1", sessions["dynaserve-alg1"], 3)
    assert [r["round"] for r in split_rounds] == [1, 2, 3]
    assert all(r["ttft_s"] is not None for r in split_rounds)
    split = [r for r in split_rounds if r["split_at"] is not None]
    assert split and all(r["route"] == "remote" and r["split_at"] % BLOCK == 0 for r in split)
    assert all(r["route"] == "local" for r in stack.rounds("coloc", sessions["coloc"], 3))


def test_bench_split_sets_the_two_mechanisms_apart_on_pools_that_can_split(tmp_path):
    command = [sys.executable, "-m", "ampd.cli", "bench", "split", "--workloads", "toolbench", "--rules", "p95",
               "--scales", "3", "--sessions", "60", "--out-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    points = json.loads((tmp_path / "split.json").read_text())["points"]
    pools = {p["pool"] for p in points}
    assert pools and all("DP=1 " not in pool for pool in pools)  # a single engine has nothing to split with
    assert {p["policy"] for p in points} == set(ARMS) and len(points) == len(pools) * len(ARMS)
    splitting = {"dynaserve", "dynaserve-alg1", "dynaserve-split-only"}
    assert all(p["split_share"] == 0 for p in points if p["policy"] not in splitting)
    assert all(p["split_share"] > 0 for p in points if p["policy"] == "dynaserve-alg1")
    assert "rounds split" in (tmp_path / "split.md").read_text()
