"""The simulator's results, held still while its code changes for speed.

Each case below runs a small trace through the simulator and compares everything its
report says - every summary and every round's TTFT and ITLs - with what the code gave
when the file in ``tests/data/`` was written, to 1e-9. The cases reach what a change for
speed could break: fused decode steps that requests join at a boundary (remote rounds),
local prefills that end them, a KV cache that preempts and evicts, split prompts,
elastic moves, and prefill and decode at different TP degrees on different GPUs.

A change meant to change results (a policy, the engine's model, a profile, a trace
generator) rewrites the file: ``AMPD_WRITE_SIM_RESULTS=1 pytest tests/test_sim_equality.py``,
and says in its commit why the results moved.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perfmodel.profile import load_profile
from perfmodel.slo import derived_slo
from planner.simulator import Pool, SimConfig, SimReport, simulate
from planner.trace import WORKLOADS, Shape, TraceSession, generate, generate_shaped
from rounds.engine.scheduler import SchedulerConfig

RESULTS = Path(__file__).parent / "data" / "sim_results.json"
TOLERANCE = 1e-9


def cases() -> Iterator[tuple[str, SimConfig, list[TraceSession]]]:
    tp2, tp4 = load_profile("llama-3.1-70b_h20_tp2"), load_profile("llama-3.1-70b_h20_tp4")
    slo = derived_slo(tp2)
    qwen = load_profile("qwen3-32b_h20_tp1")
    h1, h2 = load_profile("llama-3.1-8b_h100_tp1"), load_profile("llama-3.1-8b_h100_tp2")
    toolbench = WORKLOADS["toolbench"]
    yield "ampd-remote", SimConfig(Pool(tp4, 1), Pool(tp4, 1), slo), generate(toolbench, 250, 1.2, seed=1)
    yield "coloc", SimConfig(Pool(tp2, 2), None, slo, policy="coloc"), generate(toolbench, 250, 1.2, seed=3)
    yield (
        "coloc-kv-full",
        SimConfig(Pool(qwen, 2), None, derived_slo(qwen), policy="coloc", scheduler=SchedulerConfig(num_blocks=2000)),
        generate(WORKLOADS["gaia"], 20, 0.5, seed=6),
    )
    yield (
        "disagg-kv-full",
        SimConfig(Pool(tp2, 1), Pool(tp4, 1), slo, policy="disagg"),
        generate(WORKLOADS["gaia"], 40, 0.6, seed=5),
    )
    yield (
        "dynaserve-alg1-splits",
        SimConfig(Pool(tp2, 4), None, slo, policy="dynaserve-alg1", itl_rule="max"),
        generate(WORKLOADS["hotpotqa"], 120, 1.0, seed=11),
    )
    yield (
        "elastic-arrow-moves",
        SimConfig(Pool(tp2, 4), None, slo, policy="elastic-arrow", initial_prefill=1),
        generate_shaped(toolbench, Shape("burst", 240, 0.5, 3.0), seed=12),
    )
    yield (
        "ampd-mixed-tp-and-gpus",
        SimConfig(Pool(h2, 1), Pool(h1, 2), derived_slo(h1), policy="ampd", itl_rule="p95"),
        generate(toolbench, 250, 3.0, seed=14),
    )


def results(report: SimReport) -> dict[str, Any]:
    summary = report.model_dump(exclude={"wall_s"})
    return {"report": summary, "rounds": [list(r) for r in report.round_latencies]}


def differences(want: Any, got: Any, path: str = "") -> list[str]:
    """Where ``got`` differs from ``want``: floats by more than TOLERANCE (relative above 1),
    anything else at all."""
    if isinstance(want, dict) and isinstance(got, dict):
        if want.keys() != got.keys():
            return [f"{path}: keys {sorted(want)} != {sorted(got)}"]
        return [d for k in want for d in differences(want[k], got[k], f"{path}.{k}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: {len(want)} items != {len(got)}"]
        return [d for i, (w, g) in enumerate(zip(want, got, strict=True)) for d in differences(w, g, f"{path}[{i}]")]
    if isinstance(want, float) and isinstance(got, float):
        return [] if abs(want - got) <= TOLERANCE * max(1.0, abs(want)) else [f"{path}: {want!r} != {got!r}"]
    return [] if want == got else [f"{path}: {want!r} != {got!r}"]


def test_simulated_results_are_unchanged():
    got = {name: results(simulate(config, trace)) for name, config, trace in cases()}
    if os.environ.get("AMPD_WRITE_SIM_RESULTS") == "1":
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(RESULTS.read_text())
    assert want.keys() == got.keys()
    for name in want:
        assert want[name]["report"]["rounds"] > 50, f"{name}: too small a case to say anything"
        found = differences(want[name], got[name], name)
        assert not found, f"{len(found)} differences, first: {found[:5]}"


@pytest.mark.unit
def test_the_comparison_sees_a_change_past_the_tolerance():
    want = {"a": [1.0, 2.5e3], "b": "x"}
    assert differences(want, {"a": [1.0 + 5e-10, 2.5e3 * (1 + 5e-10)], "b": "x"}) == []
    assert differences(want, {"a": [1.0 + 2e-9, 2.5e3], "b": "x"}) == [".a[0]: 1.0 != 1.000000002"]
    assert differences(want, {"a": [1.0, 2.5e3], "b": "y"}) == [".b: 'x' != 'y'"]
    assert differences(want, {"a": [1.0], "b": "x"}) == [".a: 2 items != 1"]
