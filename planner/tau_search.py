"""Eq. 5's coefficients simulated only where the optimum can lie: bounds, then bisection.

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving", section 5, Eq. 5)
needs tau for every (phase, GPU type, degree n, replicas m). Simulating each one is what
made a 256-GPU plan take minutes: 400-odd simulations, the costliest those of one or two
replicas carrying the whole trace. But tau falls as m grows - each of m replicas gets
1/m of the trace - so one simulated tau bounds its neighbours: for m below a simulated
m', tau(m) >= tau(m'). The search keeps, per family (phase, GPU type, degree), the taus
simulated so far; every other replica count gets that lower bound. Eq. 5 is solved on the
bounds; a deployment among the best that uses a bound is a reason to simulate more of
that family - not the bounded count itself, which may be the costliest of all, but the
geometric middle of the bracket around it, so each family is bisected toward the replica
counts the optimum needs. When the best deployments use simulated taus only, no other
deployment can beat them (its true Z is at least its bound), and the search stops.

A state machine in the style of an engine scheduler - ``wanted()`` says which samples to
simulate next, ``fold()`` takes their taus back - driven by ``search`` with SCIP
(planner.ilp) and a ``measure`` that planner.plan gives the simulator. The bounds rest on
monotonicity, which the simulator obeys up to the noise of which sessions each share
holds; the whole-system simulation of the candidates (planner.plan) has the last word.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from planner.ilp import Deployment, Phase, PoolOption, solve_with_stats


@dataclass(frozen=True)
class Family:
    """The replica counts one (phase, GPU type, degree) may take, ascending."""

    phase: Phase
    gpu: str
    tp: int
    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.counts or list(self.counts) != sorted(set(self.counts)):
            raise ValueError(f"a family needs ascending distinct replica counts: {self}")


Sample = tuple[Phase, str, int, int]  # (phase, gpu, tp, replicas)


FIRST_PER_FAMILY = 3  # at 256 GPUs 3 took 8.3 s to the same answer, 4 took 14 s, 2 took 9.7 s


def first_counts(counts: Sequence[int], per_family: int = FIRST_PER_FAMILY) -> list[int]:
    """The counts to simulate before any solve: the largest (the cheapest sample, and the
    bound of every count below it) and its halvings, ``per_family`` in all."""
    picked: list[int] = []
    target = counts[-1]
    for m in reversed(counts):
        if len(picked) == per_family:
            break
        if m <= target:
            picked.append(m)
            target = m // 2
    return picked


@dataclass
class TauSearch:
    families: list[Family]
    simulated: dict[Sample, float | None] = field(default_factory=dict)  # None: no tau (no such rounds)

    def first(self) -> list[Sample]:
        return [(f.phase, f.gpu, f.tp, m) for f in self.families for m in first_counts(f.counts)]

    def fold(self, sample: Sample, tau: float | None) -> None:
        self.simulated[sample] = tau

    def options(self) -> list[PoolOption]:
        """Every count of every family: its simulated tau, or the bound the counts above it
        give (the largest tau simulated there). A count above every simulated one would
        have no bound, but the first samples hold every family's largest count."""
        options = []
        for f in self.families:
            family: list[PoolOption] = []
            bound: float | None = None
            for m in reversed(f.counts):
                sample = (f.phase, f.gpu, f.tp, m)
                if sample in self.simulated and self.simulated[sample] is None:
                    continue  # simulated, and the phase had no rounds there: no option
                tau = self.simulated.get(sample)
                if tau is not None:  # the running maximum: noise must not loosen a bound
                    bound = tau if bound is None else max(bound, tau)
                if bound is not None:
                    family.append(PoolOption(f.phase, f.gpu, f.tp, m, bound if tau is None else tau))
            options += reversed(family)  # ascending counts, as Eq. 5's ties keep input order
        return options

    def is_simulated(self, option: PoolOption) -> bool:
        return self.simulated.get((option.phase, option.gpu, option.tp, option.replicas)) is not None

    def wanted(self, best: Iterable[Deployment]) -> list[Sample]:
        """What to simulate next so that ``best`` (Eq. 5's top deployments on the current
        bounds) stands on simulated taus: for each bounded option in it, the middle of the
        bracket of simulated counts around its count. Empty when every option is simulated."""
        want: list[Sample] = []
        for d in best:
            for option in (d.prefill, d.decode):
                if self.is_simulated(option):
                    continue
                sample = self._bisect(option)
                if sample not in want:
                    want.append(sample)
        return want

    def _bisect(self, option: PoolOption) -> Sample:
        family = next(f for f in self.families if (f.phase, f.gpu, f.tp) == (option.phase, option.gpu, option.tp))
        done = {m for (p, g, t, m) in self.simulated if (p, g, t) == (family.phase, family.gpu, family.tp)}
        m = option.replicas
        above = min((c for c in done if c > m), default=None)
        below = max((c for c in done if c < m), default=0)
        inside = [c for c in family.counts if below < c < (above if above is not None else math.inf)]
        # The geometric middle: replicas halve the load, and small counts cost the most to
        # simulate, so a bracket [1, 32] is split at 6, not 16, and 1 is reached last.
        target = math.sqrt(max(below, 1) * above) if above is not None else m
        middle = min(inside, key=lambda c: (abs(math.log(c / target)), -c))
        return (family.phase, family.gpu, family.tp, middle)


@dataclass(frozen=True)
class Found:
    options: list[PoolOption]  # every count: simulated taus, bounds elsewhere
    best: list[Deployment]  # Eq. 5's best ``top``, every tau of theirs simulated
    solve_s: float  # SCIP's time, all solves together


def search(
    families: list[Family],
    measure: Callable[[Sequence[Sample]], list[float | None]],
    capacity: Mapping[str, int],
    top: int,
) -> Found:
    """Eq. 5's ``top`` deployments: each family's first samples, then, until the best stand
    on simulated taus only, the samples ``wanted`` for them. ``measure`` gives the taus of
    a batch of samples (run side by side by planner.plan)."""
    state = TauSearch(families)
    wanted, solve_s = state.first(), 0.0
    while True:
        for sample, tau in zip(wanted, measure(wanted), strict=True):
            state.fold(sample, tau)
        options = state.options()
        best, stats = solve_with_stats(options, capacity, top=top)
        solve_s += sum(stats.seconds)
        wanted = state.wanted(best)
        if not wanted:
            return Found(options, best, solve_s)
