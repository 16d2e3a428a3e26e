"""`ampd bench sensitivity`: how much the paper grid's verdicts hang on the roofline's GEMM efficiency.

Every cell of `ampd bench paper` names a winner, and every winner rests on the profiles'
costs, which rest on a handful of constants (perfmodel.roofline). The one that moves
prefill most is the GEMM efficiency: the shipped profiles price BF16 GEMMs at 0.45 of
peak, the project's kernel timings put them near 0.6 on H100 and H200, and a reading of
published H20 figures nearer 0.75 (docs/studies/calibration.md). So the grid is run again
at each trace's knee with the profiles derived at each efficiency of a sweep, everything
else the same, and each cell's winners are set side by side: where a winner changes, the
verdict depends on a figure nobody has measured on that GPU.

The same machinery answers where the model stands against the paper's own operating
point (``--points hotpotqa=2``: HotpotQA on 8 H20 at 2 sessions/s, its Figure 4
breakdown): the best attainment any policy reaches there at each efficiency.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.progress import Progress

from bench.paper import Cell, GridPoint, cell_points, run_trace, winners
from perfmodel.profile import Efficiency
from planner.plan import ProfileBook


@dataclass(frozen=True)
class CellVerdict:
    workload: str
    rate: float
    efficiency: float
    rule: str
    scale: float
    winners: list[str]
    best_attainment: float
    attainment: dict[str, float]  # every policy's, on its best deployment


def sweep(
    model: str,
    gpu: str,
    base: Efficiency,
    efficiencies: Sequence[float],
    points: Sequence[tuple[str, float]],
    cells: Sequence[Cell],
    sessions: int,
    seed: int,
    progress: Progress | None = None,
) -> list[CellVerdict]:
    """At each GEMM efficiency, each (workload, rate) point of the grid, every policy on its
    best deployment (bench.paper.run_trace) with profiles derived at that efficiency."""
    out = []
    for compute in efficiencies:
        efficiency = base.model_copy(update={"compute": compute, "source": f"{base.source}; compute {compute:g}"})
        book = ProfileBook(model, (), efficiency)
        for workload, rate in points:
            grid = run_trace(book, gpu, workload, [rate], sessions, cells, seed, progress)
            for cell in cells:
                here: list[GridPoint] = cell_points(grid, cell)
                best = winners(here)[(workload, rate)]
                attainment = {p.policy: p.slo_attainment_rounds for p in here}
                out.append(CellVerdict(workload, rate, compute, cell.rule, cell.scale, best,
                                       max(attainment.values()), attainment))  # fmt: skip
    return out


def by_cell(verdicts: Sequence[CellVerdict]) -> Iterator[tuple[tuple[str, float, str, float], list[CellVerdict]]]:
    """Each (workload, rate, rule, scale) in the order first met, with its verdicts by efficiency."""
    rows: dict[tuple[str, float, str, float], list[CellVerdict]] = {}
    for v in verdicts:
        rows.setdefault((v.workload, v.rate, v.rule, v.scale), []).append(v)
    for key, row in rows.items():
        yield key, sorted(row, key=lambda v: v.efficiency)


def changes(verdicts: Sequence[CellVerdict]) -> list[str]:
    """For each (workload, rate, cell): its winners at each efficiency, and where they change."""
    lines = []
    for (workload, rate, rule, scale), row in by_cell(verdicts):
        shown = "; ".join(f"{v.efficiency:g}: {', '.join(v.winners)} ({v.best_attainment:.0%})" for v in row)
        moves = [f"{a.efficiency:g} -> {b.efficiency:g}" for a, b in zip(row, row[1:], strict=False)
                 if set(a.winners) != set(b.winners)]  # fmt: skip
        lines.append(f"| {workload} | {rate:g} | {rule}, x{scale:g} | {shown} | {', '.join(moves) or 'none'} |")
    return lines


# The published verdicts, each a comparison of two sides' attainment in a cell: AMPD's
# routing against always-remote disaggregation and against colocation, and step sizing
# (the better of its two policies) against the best policy without it.
SIZING = ("dynaserve", "elastic-split")
PAIRS = (("ampd vs disagg", ("ampd",), ("disagg",)), ("ampd vs coloc", ("ampd",), ("coloc",)),
         ("step sizing vs best other", SIZING, None))  # fmt: skip


def pair_lines(verdicts: Sequence[CellVerdict]) -> list[str]:
    """Per (workload, rate, cell) and verdict: each side's attainment at each efficiency, and
    whether the side ahead changes along the sweep."""
    lines = []
    for (workload, rate, rule, scale), row in by_cell(verdicts):
        for name, ours, theirs in PAIRS:
            sides = [_sides(v.attainment, ours, theirs) for v in row]
            shown = "; ".join(f"{v.efficiency:g}: {a:.0%} vs {b:.0%}" for v, (a, b) in zip(row, sides, strict=True))
            ahead = {("ahead" if a > b + 0.005 else "behind" if b > a + 0.005 else "even") for a, b in sides}
            lines.append(f"| {workload} | {rate:g} | {rule}, x{scale:g} | {name} | {shown} | "
                         f"{'flips' if len(ahead - {'even'}) > 1 else 'holds'} |")  # fmt: skip
    return lines


def _sides(attainment: dict[str, float], ours: Sequence[str], theirs: Sequence[str] | None) -> tuple[float, float]:
    rest = theirs if theirs is not None else [p for p in attainment if p not in ours]
    return max(attainment[p] for p in ours), max(attainment[p] for p in rest)


def write(out_dir: Path, title: str, verdicts: Sequence[CellVerdict]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / "sensitivity.json"
    data.write_text(json.dumps({"title": title, "verdicts": [asdict(v) for v in verdicts]}, indent=2) + "\n")
    table = out_dir / "sensitivity.md"
    header = ["| trace | sessions/s | cell | winners at each GEMM efficiency (best attainment) | winner changes |",
              "| --- | ---: | --- | --- | --- |"]  # fmt: skip
    pairs = ["| trace | sessions/s | cell | verdict | attainment at each GEMM efficiency | along the sweep |",
             "| --- | ---: | --- | --- | --- | --- |"]  # fmt: skip
    table.write_text(f"# {title}\n\n## The published verdicts\n\n" + "\n".join(pairs + pair_lines(verdicts))
                     + "\n\n## Each cell's winners\n\n" + "\n".join(header + changes(verdicts)) + "\n")  # fmt: skip
    return [data, table]
