"""Where Eq. 5's split of GPUs between the phases is wrong for the serving policy: a climb.

Eq. 5 (AMPD, "Efficient Multi-round LLM Inference over Disaggregated Serving", section 5)
prices each phase on its own, every prefill remote. AMPD's policy, and the production
rules that prefill short increments locally, move prefill work onto the decode engines,
so the best split gives decode more GPUs than Eq. 5 does: simulated whole, Eq. 5's best
candidates can fall far short of the best configuration, with a prefill pool Eq. 5 rates
well past its SLO on its own (docs/studies/planner.md).

So when the best candidate misses rounds, the planner climbs: from the best simulated
candidate of each pair of degrees it moves one replica at a time from one phase to the
other - the freed GPUs to as many replicas of the other phase as fit - and keeps going
while the whole-system simulation's SLO attainment rises, looking ``PATIENCE`` steps past
a worse one: attainment need not be smooth in the split (a replica more or less changes
where rounds are routed), though on the traces measured so far each climb rose
steadily. Pure: ``step`` says what to simulate next from a climb's
position; the caller simulates it and folds the result back with ``moved``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner.ilp import Deployment, PoolOption

Direction = str  # "decode" (a prefill replica's GPUs to decode) or "prefill"


def shifted(d: Deployment, toward: Direction, options: Sequence[PoolOption], capacity: Mapping[str, int]):
    """``d`` with one replica fewer on the giving phase and as many more on the other as
    the freed GPUs allow (its own type's capacity); None when the giving phase has one
    replica, the other gains none, or a count has no option."""
    give, take = (d.prefill, d.decode) if toward == "decode" else (d.decode, d.prefill)
    if give.replicas == 1:
        return None
    used = {gpu: 0 for gpu in capacity}
    used[give.gpu] += give.tp * (give.replicas - 1)
    used[take.gpu] += take.tp * take.replicas
    room = (capacity.get(take.gpu, 0) - used[take.gpu]) // take.tp
    if room < 1:
        return None
    by_key = {(o.phase, o.gpu, o.tp, o.replicas): o for o in options}
    fewer = by_key.get((give.phase, give.gpu, give.tp, give.replicas - 1))
    more = by_key.get((take.phase, take.gpu, take.tp, take.replicas + room))
    if fewer is None or more is None:
        return None
    return Deployment.of(fewer, more) if toward == "decode" else Deployment.of(more, fewer)


PATIENCE = 2  # worse steps in a row before a way closes (attainment need not be smooth in the split)


@dataclass
class Climb:
    """One climb: the best deployment it found (its attainment key, lower is better), the
    one it probes from, how many steps in a row found nothing better, and the ways left."""

    best: Deployment
    key: tuple[float, float]
    ways: list[Direction]
    probe: Deployment | None = None
    misses: int = 0

    def step(self, options: Sequence[PoolOption], capacity: Mapping[str, int]) -> Deployment | None:
        """The next deployment to try, closing ways that lead nowhere."""
        while self.ways:
            nxt = shifted(self.probe or self.best, self.ways[0], options, capacity)
            if nxt is not None:
                return nxt
            self._close()
        return None

    def moved(self, tried: Deployment, key: tuple[float, float]) -> None:
        """Fold a tried step back: a higher attainment is the new best (and the way back
        only undoes it); ``PATIENCE`` worse steps in a row close the way."""
        self.probe = tried
        if key[0] < self.key[0]:
            self.best, self.key, self.misses = tried, key, 0
            self.ways = self.ways[:1]
        else:
            self.misses += 1
            if self.misses > PATIENCE:
                self._close()

    def _close(self) -> None:
        self.ways.pop(0)
        self.probe, self.misses = None, 0
