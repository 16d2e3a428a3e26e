"""`ampd bench stepsize --engine vllm`, run small: ampd's step sizing inside one real vLLM engine
(its CPU build) against one of vLLM's static budgets, a few streams and one long prompt. Its
worth - which scheduler keeps the gaps short - is the study's (docs/studies/stepsize.md); here,
that every arm ran on vLLM and the report holds each in its shape. The bench has no GPU-free
engine (the GPU-free counterpart is `ampd bench split`): without vLLM only its refusals run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.stepsize import STATICS, StaticBudget, parse_statics, steps_to_converge
from perfmodel.step_correction import MAX_FACTOR
from tests.test_vllm import QUICK_START, ROOT, VLLM_PYTHON, VLLM_TIMEOUT

REDIS_URL = "redis://127.0.0.1:6379/13"
BENCH = [sys.executable, "-m", "ampd.cli", "bench", "stepsize"]


@pytest.mark.unit
def test_static_budgets_parse_as_vllms_options_read():
    assert parse_statics("2048:256,2048:512,2048:256:adaptive,512,1024") == STATICS
    assert parse_statics(" 1024 , 2048:128 ") == (StaticBudget(1024), StaticBudget(2048, 128))
    for bad in ("", "x", "0", "512:adaptive", "512:0:adaptive", "512:256:fair", "512:1:adaptive:2", "512:-1"):
        with pytest.raises(ValueError):
            parse_statics(bad)


@pytest.mark.unit
def test_a_correction_has_settled_from_the_step_after_its_last_move_beyond_a_tenth():
    assert steps_to_converge([1.0] * 5) == 0
    assert steps_to_converge([1.0, 1.0, 1.6, 2.1, 1.95, 2.0]) == 3
    assert steps_to_converge([1.0, 2.0, 1.0]) == 2


def test_the_command_refuses_what_it_cannot_measure():
    """No vLLM needed: the options are checked before an engine starts."""
    refusals = ((["--engine", "sim"], "ampd bench split"), (["--statics", "512:adaptive"], "bad static"),
                (["--baselines", "fastest"], "bad --baselines"), (["--streams", "0"], "at least one"),
                (["--profile-skew", "0"], "profile skew"))  # fmt: skip
    for options, message in refusals:
        done = subprocess.run([*BENCH, *options], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in " ".join(done.stdout.split()), (options, done.stdout + done.stderr)


@VLLM_TIMEOUT
def test_a_small_stepsize_run_sets_ampds_scheduler_beside_a_static_budget_in_vllm(tmp_path):
    """Two arms, each on a fresh engine: vLLM's scheduler with a capped budget (a static arm,
    which runs vLLM's scheduler as the default arm does) and ampd's with its target, from a
    profile whose step costs are skewed. vLLM's
    default arm is left out (``--baselines static``): a third engine start would double the
    minute the bench needs once its engines are up."""
    if not Path(VLLM_PYTHON).exists():
        pytest.skip(f"vLLM's CPU build is not installed at {VLLM_PYTHON} (`make test` installs it)")
    out, work = tmp_path / "stepsize.json", tmp_path / "work"
    command = [*BENCH, "--engine", "vllm", "--streams", "2", "--long-prompts", "1", "--long-tokens", "512",
               "--interval", "1", "--baselines", "static", "--statics", "2048:256", "--profile-skew", "2",
               "--redis-url", REDIS_URL,
               "--work-dir", str(work), "--out", str(out), "--vllm-options", " ".join(QUICK_START)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=840,
                          env={**os.environ, "AMPD_VLLM_PYTHON": VLLM_PYTHON})  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["engine"] == "vllm"
    assert report["setup"]["statics"] == ["budget 2048, cap 256"] and report["setup"]["long_prompts"] == 1
    arms = report["arms"]
    assert set(arms) == {"static", "ampd"}, arms
    assert [s["label"] for s in report["statics"]] == ["budget 2048, cap 256"] == [arms["static"]["label"]]
    for name, arm in arms.items():
        # Tokens streamed while the long prompt was in the engine, and the long prompt was answered:
        # a step or two of its prefill, whose length a loaded machine sets (8 gaps in one CI run).
        assert arm["gaps"] >= 2, (name, arm)
        assert 0 < arm["p95_gap_ms"] <= arm["max_gap_ms"] < 10_000, (name, arm)
        assert arm["decode_tokens_per_s"] > 1 and 0 < arm["long_prompt_ttft_ms"] < 60_000, (name, arm)
    assert arms["static"]["target_ms"] is None and arms["ampd"]["target_ms"] > 0
    # ampd's scheduler priced every step against the target it was handed, within vLLM's budget.
    target_s = arms["ampd"]["target_ms"] / 1e3
    steps = report["ampd_steps"]
    assert steps and all(s["target_s"] == pytest.approx(target_s, rel=1e-3) for s in steps)
    assert all(0 < s["budget"] <= s["full"] == 2048 for s in steps)
    assert any(s["prefill_tokens"] > 0 for s in steps)  # the long prompt went through the sized steps
    # It timed its steps and corrected the profile's prices from them: from 1 (the profile as
    # handed, its step costs doubled) to the engine's own. Doubled, so that its small chunks give
    # it prefill steps to learn from (halved, one 512-token prompt took too few); how far the
    # factor moves is the engine's: eager (-O0) here, slower than the compiled one profiled.
    factors = [s["factor"] for s in steps]
    assert all(s["measured_s"] > 0 for s in steps) and factors[0] == 1.0 and any(f != 1.0 for f in factors)
    assert all(1 / MAX_FACTOR <= f <= MAX_FACTOR for f in factors)
    assert report["setup"]["profile_skew"] == 2.0
    assert 0 <= arms["ampd"]["steps_to_converge"] < len(steps) and arms["static"]["steps_to_converge"] is None
    assert arms["ampd"]["busy_step_ms_p50"] is None or arms["ampd"]["busy_step_ms_p50"] > 0
    # vLLM served both arms, the static one with its cap and its own scheduler.
    static_log = (work / "static" / "vllm-1.log").read_text()
    assert "POST /v1/completions" in static_log and "'long_prefill_token_threshold': 256" in static_log
    assert "POST /v1/completions" in (work / "ampd" / "vllm-1.log").read_text()
