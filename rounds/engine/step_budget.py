"""How many prefill tokens a step may carry while requests decode: SLO-aware step sizing.

DynaServe ("DynaServe: Unified and Elastic Execution for Dynamic Disaggregated LLM
Serving", section 4.2, Alg. 2: MaxPrefillAllowed) sizes each batch's prefill to what its
decodes leave under the TBT SLO: every decoding request waits for the whole step, so a
step's time is every stream's token gap. The step time is the engine's profile's
(``Profile.step_time``), monotone in the prefill's tokens, so the largest fitting chunk is
found by bisection.

One function serves both engines, so the simulator predicts what a real one does:
:func:`prefill_within_target` sizes each chunk of the GPU-free engine's steps
(rounds.engine.scheduler), :func:`step_token_budget` the whole step of ampd's scheduler
inside vLLM (workers.vllm.step_sizing), whose own loop then shares the budget out.
"""

from __future__ import annotations

from collections.abc import Sequence

from perfmodel.profile import Profile

# The least prefill a step carries while requests decode, so that a prefill progresses when
# the decodes alone fill the target. Not a KV block: vLLM chunks a prompt anywhere, and
# its CPU build's 128-token blocks would make the floor a long step of its own.
MIN_PREFILL_TOKENS = 16


def prefill_within_target(
    profile: Profile,
    target_s: float,
    decoding: Sequence[int],
    chosen: Sequence[tuple[int, int]],
    context: int,
    n: int,
) -> int:
    """At most ``n`` prefill tokens at history ``context`` that keep the step - the prefill
    chunks ``chosen`` so far (l_hist, l_incr) and one token for each decoding context -
    within ``target_s``. The step's first prefill takes at least MIN_PREFILL_TOKENS of it."""

    def fits(k: int) -> bool:
        return profile.step_time([*chosen, (context, k)], decoding) <= target_s

    if fits(n):
        return n
    floor = 0 if chosen else min(MIN_PREFILL_TOKENS, n)
    lo, hi = floor, n  # fits(hi) is false; lo is the answer unless a larger one fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def step_token_budget(profile: Profile, target_s: float, decoding: Sequence[int], context: int, full: int) -> int:
    """A whole step's token budget: a token for each decoding request and the prefill tokens
    (at history ``context``) that keep the step within ``target_s``, at most ``full``; with
    nothing decoding, or no target, ``full`` (a lone prefill takes the whole budget)."""
    if not decoding or target_s <= 0 or len(decoding) >= full:
        return full
    room = full - len(decoding)
    return len(decoding) + prefill_within_target(profile, target_s, decoding, (), context, room)
