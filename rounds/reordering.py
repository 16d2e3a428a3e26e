"""In what order a worker's queued prefills run: AMPD's TTFT-aware reordering (Alg. 2).

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving"), section 4.2. Pure: no I/O. At each dispatch the
head window of w tasks is reordered to maximise the number of tasks predicted to meet
TTFT_thres (Eq. 3-4), skipping orderings that postpone a task already postponed w
times; the head of the chosen order runs next.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class QueuedTask:
    task_id: str
    created_at: float  # T_enq: when the task's TTFT clock started
    estimate_s: float  # t_pre on this worker (wall clock)
    ttft_thres_s: float  # its model's TTFT_thres (wall clock)
    postponed: int = 0  # how often reordering has put it behind a later task
    incremental: bool = False


@dataclass(frozen=True)
class Decision:
    order: tuple[int, ...]  # indexes into the window, the chosen permutation pi*
    postponed: tuple[int, ...]  # window indexes whose counters go up
    satisfied: int  # S_pi*


def satisfied(window: Sequence[QueuedTask], order: Sequence[int], now: float) -> int:
    """Eq. 3-4: tasks of the window meeting their TTFT threshold if run in ``order``."""
    done, count = 0.0, 0
    for index in order:
        task = window[index]
        done += task.estimate_s  # Eq. 3: C of the k-th task is the sum of the first k
        if (now - task.created_at) + done <= task.ttft_thres_s:
            count += 1
    return count


def postponed_by(order: Sequence[int]) -> tuple[int, ...]:
    """Tasks that some task from behind them overtakes in ``order``."""
    out = []
    for position, index in enumerate(order):
        if any(later > index for later in order[:position]):
            out.append(index)
    return tuple(sorted(out))


def reorder(window: Sequence[QueuedTask], now: float, cap: int) -> Decision:
    """AMPD Alg. 2 over the head window (the caller peeks w tasks; the cap is w)."""
    identity = tuple(range(len(window)))
    best: Decision | None = None
    for order in itertools.permutations(identity):
        pushed = postponed_by(order)
        if any(window[i].postponed >= cap for i in pushed):  # lines 3-4: starvation cap
            continue
        score = satisfied(window, order, now)
        if best is None or score > best.satisfied:  # line 6: first best wins ties (FIFO first)
            best = Decision(order, pushed, score)
    assert best is not None  # the identity order postpones nobody
    return best
