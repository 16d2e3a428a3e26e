"""`ampd bench stepsize --engine vllm`: ampd's step sizing inside real vLLM, against vLLM's own budgets.

One vLLM engine (its CPU build, pinned to a core) serves the fidelity bench's model
(bench.fidelity). Streams decode throughout while long prompts arrive one after another:
the case where a fixed token budget puts a long chunk beside every decode and each
stream's next token waits for it. Three arms, each on a fresh engine:

- ``default``: vLLM's scheduler with its CPU build's budget (2,048 tokens a step);
- ``static``: the best of a searched set of fixed budgets - ``--max-num-batched-tokens``,
  ``--long-prefill-token-threshold`` with and without its adaptive floor - by P95 gap;
- ``ampd``: ampd's scheduler (workers.vllm.step_sizing) with a step target; by default
  the one the gateway hands an engine under ``dynaserve`` and the P95 rule
  (rounds.policies.step_target) for the SLO derived from the engine's profile.

Per arm: the streams' token gaps while long prompts are in the engine (P95, max), the
streams' decode tokens per second over that window, and the long prompts' TTFT. For
ampd's: the steps its price correction took to settle (perfmodel.step_correction) and
the median time of the steps whose prefill its budget cut short - the budget used, not
wasted. ``--profile-skew F`` hands ampd's scheduler the profile with its step costs
times F (its target still the unskewed profile's), to show the correction converge.
Replies are sampled among letters (``allowed_token_ids``), so every token is a chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import statistics
import string
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from ampd.stack import STATE_DIR
from bench.fidelity import SCHEDULER, VLLM_ARGS, bench_redis, build_model, engines, letter_ids, repo_path, setup_dict
from perfmodel.profile import load_profile
from perfmodel.slo import derived_slo
from rounds.policies import step_target_ms

PROFILE = Path("bench/results/fidelity_vllm/tiny-llama-cpu_measured.json")
ENGINE_CORE = 1  # the load generator keeps to the other
CONVERGED = 0.1  # a correction within this of its final value has settled


@dataclass(frozen=True)
class StaticBudget:
    """One of vLLM's fixed budgets: tokens a step, a request's tokens a step (0: no cap), and
    whether that cap is floored at a fair share of the budget (vLLM's adaptive threshold)."""

    max_num_batched_tokens: int = SCHEDULER.max_num_batched_tokens
    long_prefill_token_threshold: int = 0
    adaptive: bool = False

    @property
    def label(self) -> str:
        cap = f", cap {self.long_prefill_token_threshold}" if self.long_prefill_token_threshold else ""
        return f"budget {self.max_num_batched_tokens}{cap}{' adaptive' if self.adaptive else ''}"

    def vllm_args(self) -> tuple[str, ...]:
        base = list(VLLM_ARGS)
        at = base.index("--max-num-batched-tokens")
        base[at + 1] = str(self.max_num_batched_tokens)
        if self.long_prefill_token_threshold:
            base += ["--long-prefill-token-threshold", str(self.long_prefill_token_threshold)]
        if self.adaptive:
            base.append("--long-prefill-token-threshold-adaptive")
        return tuple(base)


STATICS = (
    StaticBudget(long_prefill_token_threshold=256),
    StaticBudget(long_prefill_token_threshold=512),
    StaticBudget(long_prefill_token_threshold=256, adaptive=True),
    StaticBudget(max_num_batched_tokens=512),
    StaticBudget(max_num_batched_tokens=1024),
)


def parse_statics(spec: str) -> tuple[StaticBudget, ...]:
    """``--statics``: the fixed budgets searched, comma-separated, each ``TOKENS[:CAP[:adaptive]]`` -
    tokens a step, a request's tokens a step (0: no cap), and ``adaptive`` to floor that cap at a
    fair share of the budget (vLLM's adaptive threshold; it needs a cap)."""
    budgets = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        parts = item.split(":")
        try:
            tokens, cap = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
        except ValueError:
            tokens, cap = 0, 0
        adaptive = parts[2:] == ["adaptive"]
        if len(parts) > 3 or (len(parts) == 3 and not adaptive) or tokens < 1 or cap < 0 or (adaptive and not cap):
            raise ValueError(f"bad static budget {item!r}: TOKENS[:CAP[:adaptive]], with a cap for adaptive")
        budgets.append(StaticBudget(tokens, cap, adaptive))
    if not budgets:
        raise ValueError("at least one static budget: TOKENS[:CAP[:adaptive]], comma-separated")
    return tuple(budgets)


BASELINES = ("default", "static")  # vLLM's scheduler with its default budget; the best of the static ones


@dataclass(frozen=True)
class StepsizeSetup:
    streams: int = 8
    stream_prompt_tokens: int = 48
    stream_tokens: int = 200  # a stream's request; it sends the next when one ends
    long_prompts: int = 4
    long_tokens: int = 2400
    interval_s: float = 3.0  # between the long prompts' arrivals
    target_ms: float | None = None  # None: dynaserve's under the P95 rule
    statics: tuple[StaticBudget, ...] = STATICS
    profile: Path = PROFILE
    out_dir: Path = STATE_DIR / "stepsize"
    redis_url: str = "redis://127.0.0.1:6379/11"
    vllm_python: str = ""
    seed: int = 0
    baselines: tuple[str, ...] = BASELINES  # vLLM's own arms run beside ampd's
    profile_skew: float = 1.0  # ampd's scheduler starts from the profile's step costs times this
    vllm_options: tuple[str, ...] = ()  # appended to each arm's vLLM arguments (``-O0``: no torch.compile)


@dataclass
class ArmResult:
    arm: str
    label: str
    p95_gap_ms: float
    max_gap_ms: float
    decode_tokens_per_s: float
    long_prompt_ttft_ms: float
    target_ms: float | None
    gaps: int
    steps_to_converge: int | None = None  # ampd's arm: steps until its correction settled
    busy_step_ms_p50: float | None = None  # ampd's arm: steps its budget bound, their median time
    steps: list[dict] = field(default_factory=list)  # ampd's arm: the engine's step log


def default_target_ms(profile_path: Path) -> float:
    """What the gateway hands an engine under dynaserve and the P95 rule (rounds.policies.step_target)."""
    return step_target_ms("dynaserve", derived_slo(load_profile(profile_path)), "p95")


def run_stepsize(console: Console, setup: StepsizeSetup, out: Path | None) -> int:
    setup.out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(setup.out_dir / "model")
    target_ms = setup.target_ms if setup.target_ms is not None else default_target_ms(setup.profile)
    priced = setup.profile  # what ampd's scheduler prices steps with: the profile, skewed if asked
    if setup.profile_skew != 1.0:
        priced = setup.out_dir / "profile_skewed.json"
        skewed = load_profile(setup.profile).with_step_costs_scaled(setup.profile_skew)
        priced.write_text(skewed.model_dump_json(indent=2) + "\n")
    arms = [*([("default", StaticBudget(), None)] if "default" in setup.baselines else []),
            *(("static", s, None) for s in (setup.statics if "static" in setup.baselines else ())),
            ("ampd", StaticBudget(), target_ms)]  # fmt: skip
    results: dict[str, ArmResult] = {}
    statics: list[ArmResult] = []
    try:
        with bench_redis(setup.redis_url, setup.out_dir) as redis_url:
            for arm, budget, target in arms:
                label = budget.label if target is None else f"ampd's scheduler, target {target:.1f} ms"
                with console.status(f"{arm}: {label}"):
                    result = _arm(setup, model, priced, redis_url, arm, budget, target)
                console.print(f"{arm} ({label}): gap p95 {result.p95_gap_ms:.0f} ms, max {result.max_gap_ms:.0f} ms, "
                              f"{result.decode_tokens_per_s:.1f} decode tokens/s, long-prompt TTFT "
                              f"{result.long_prompt_ttft_ms:.0f} ms")  # fmt: skip
                if result.steps_to_converge is not None:
                    settled, busy = result.steps[-1]["factor"], result.busy_step_ms_p50 or 0
                    console.print(f"  its prices settled after {result.steps_to_converge} steps at x{settled:.2f}; "
                                  f"the steps its budget cut short took {busy:.0f} ms at the median")  # fmt: skip
                if arm == "static":
                    statics.append(result)
                else:
                    results[arm] = result
    except RuntimeError as exc:
        console.print(f"[red]{exc}[/red]")
        return 1
    if statics:
        results["static"] = min(statics, key=lambda r: (r.p95_gap_ms, r.long_prompt_ttft_ms))
    console.print(_table(results))
    if out is not None:
        document = {"engine": "vllm", "profile": repo_path(setup.profile), "setup": _setup_dict(setup),
                    "arms": {arm: _public(r) for arm, r in results.items()},
                    "statics": [_public(r) for r in statics],
                    "ampd_steps": results["ampd"].steps}  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(document, indent=2) + "\n")
        console.print(f"wrote {out}")
    return 0


def _arm(
    setup: StepsizeSetup,
    model: Path,
    profile: Path,
    redis_url: str,
    arm: str,
    budget: StaticBudget,
    target: float | None,
) -> ArmResult:
    log_dir = setup.out_dir / arm
    log_dir.mkdir(parents=True, exist_ok=True)
    steps = log_dir / "steps.jsonl"
    steps.unlink(missing_ok=True)
    if target is None:  # vLLM's own scheduler (the default and static arms), else ampd's with its target
        options = ["--no-step-sizing"]
    else:
        options = ["--step-target-ms", f"{target:g}", "--step-log", str(steps.resolve())]
    arm_engines = engines(setup.vllm_python, model, str(profile), redis_url, log_dir, cores=(ENGINE_CORE,),
                          options=options, vllm_args=budget.vllm_args(), vllm_options=setup.vllm_options)  # fmt: skip
    with arm_engines as e, _pinned({1 - ENGINE_CORE}):
        gaps, tokens, window, ttfts = asyncio.run(_workload(e.urls[0], setup, letter_ids(model)))
    label = budget.label if target is None else "ampd's scheduler"
    logged = [json.loads(line) for line in steps.read_text().splitlines()] if steps.exists() else []
    busy = [s["measured_s"] for s in logged if s["prefill_tokens"] and s["scheduled"] >= s["budget"]]
    return ArmResult(arm, label, 1e3 * float(np.percentile(gaps, 95)), 1e3 * max(gaps), tokens / window,
                     1e3 * statistics.mean(ttfts), target, len(gaps),
                     steps_to_converge(s["factor"] for s in logged) if logged else None,
                     1e3 * statistics.median(busy) if busy else None, logged)  # fmt: skip


def steps_to_converge(factors: Iterable[float], tolerance: float = CONVERGED) -> int:
    """How many steps the correction took to settle: the first step from which every
    step's factor stays within ``tolerance`` of the last one's."""
    seen = list(factors)
    final, settled = seen[-1], len(seen) - 1
    while settled > 0 and abs(seen[settled - 1] / final - 1) <= tolerance:
        settled -= 1
    return settled


@contextlib.contextmanager
def _pinned(cores: set[int]):
    """This process (the load generator) on ``cores`` for the while, off the engine's core."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


async def _workload(
    url: str, setup: StepsizeSetup, letters: Sequence[int]
) -> tuple[list[float], int, float, list[float]]:
    """Streams decoding throughout; the long prompts one after another once they all decode.
    Returns the streams' gaps and tokens within the long prompts' window, its length, and the
    long prompts' TTFTs."""
    rng = random.Random(setup.seed)

    def text(n: int) -> str:
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))

    window: list[float] = []  # [start, end] once set
    gaps: list[float] = []
    counted = [0]
    started = [asyncio.Event() for _ in range(setup.streams)]
    stop = asyncio.Event()

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not stop.is_set():
            body = {"model": "tiny-llama", "prompt": text(setup.stream_prompt_tokens), "ignore_eos": True,
                    "max_tokens": setup.stream_tokens, "stream": True, "cache_salt": f"stream-{i}-{n}",
                    "allowed_token_ids": list(letters)}  # fmt: skip
            last = None
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"a stream got {response.status_code}: {(await response.aread())[:300]!r}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        started[i].set()
                        if len(window) == 1:
                            gaps.append(now - last)
                            counted[0] += 1
                    last = now
            n += 1

    async def long_prompts(client: httpx.AsyncClient) -> list[float]:
        await asyncio.gather(*(e.wait() for e in started))
        window.append(time.perf_counter())
        ttfts, pending = [], []

        async def one(j: int) -> None:
            body = {"model": "tiny-llama", "prompt": text(setup.long_tokens), "max_tokens": 1,
                    "cache_salt": f"long-{j}", "allowed_token_ids": list(letters)}  # fmt: skip
            sent = time.perf_counter()
            response = await client.post(f"{url}/v1/completions", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"a long prompt got {response.status_code}: {response.text[:300]}")
            ttfts.append(time.perf_counter() - sent)

        for j in range(setup.long_prompts):
            pending.append(asyncio.create_task(one(j)))
            await asyncio.sleep(setup.interval_s)
        await asyncio.gather(*pending)
        window.append(time.perf_counter())
        stop.set()
        return ttfts

    async with httpx.AsyncClient(timeout=600) as client:
        streams = [asyncio.create_task(stream(client, i)) for i in range(setup.streams)]
        ttfts = await long_prompts(client)
        await asyncio.gather(*streams)
    return gaps, counted[0], window[1] - window[0], ttfts


def _public(r: ArmResult) -> dict:
    return {k: v for k, v in asdict(r).items() if k != "steps"}


def _setup_dict(setup: StepsizeSetup) -> dict:
    return setup_dict(setup) | {"statics": [s.label for s in setup.statics]}


def _table(results: dict[str, ArmResult]) -> Table:
    table = Table("arm", "scheduler", "gap p95", "gap max", "decode tokens/s", "long-prompt TTFT", "target")
    for arm in (a for a in ("default", "static", "ampd") if a in results):
        r = results[arm]
        target = "-" if r.target_ms is None else f"{r.target_ms:.1f} ms"
        table.add_row(arm, r.label, f"{r.p95_gap_ms:.0f} ms", f"{r.max_gap_ms:.0f} ms", f"{r.decode_tokens_per_s:.1f}",
                      f"{r.long_prompt_ttft_ms:.0f} ms", target)  # fmt: skip
    return table
