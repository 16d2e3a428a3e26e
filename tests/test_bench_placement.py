"""`ampd bench placement` on a small shared-prefix trace: every rule, every seed, simulated."""

from __future__ import annotations

from bench import placement
from perfmodel.profile import load_profile
from perfmodel.slo import DEFAULT_SCALE
from planner.trace import Agents
from rounds.placement import PLACEMENTS


def test_every_placement_runs_on_every_seed_and_the_caches_save_prefill_work():
    """Two agent types share their long prompts among 60 sessions on 1 + 2 engines: every
    rule runs on both traces; placing by the caches computes less prefill than ``memory``
    on each; the table reads the rows over the seeds."""
    setup = placement.Setup(load_profile("llama-3.1-8b_h100_tp1"), 1, 2, "toolbench", Agents(2, 1), 60, 0, "ampd",
                            DEFAULT_SCALE)  # fmt: skip
    rows = placement.run_placement(setup, 0.5, ["mean"], [0, 1], workers=2)
    assert sorted((r.placement, r.seed) for r in rows) == sorted((p, s) for p in PLACEMENTS for s in (0, 1))
    assert all(0.0 <= r.attainment <= 1.0 and r.prefill_tokens > 0 and r.itl_rule == "mean" for r in rows)
    tokens = {(r.placement, r.seed): r.prefill_tokens for r in rows}
    for seed in (0, 1):
        assert tokens[("ampd", seed)] < tokens[("memory", seed)], tokens
        assert tokens[("llmd-prefix", seed)] < tokens[("memory", seed)], tokens
    summary = {s.placement: s for s in placement.summarize_rows(rows)}
    assert set(summary) == set(PLACEMENTS) and all(s.seeds == 2 for s in summary.values())
    for name, s in summary.items():
        mine = [r.attainment for r in rows if r.placement == name]
        assert (s.attainment_min, s.attainment_max) == (min(mine), max(mine))
    assert sum(s.best_on for name, s in summary.items() if name != "memory") >= 2  # a best on each seed
    assert placement.table(rows).count("\n") == 1 + len(PLACEMENTS)
