"""Engine roles: the gateway's assignment of what each engine does. Pure: no I/O.

Every engine runs vLLM's connector as ``kv_both``, so its role is only the gateway's
decision of what to send it - it changes with no restart, as Arrow's stateless
instances do ("Arrow: Adaptive Scheduling Mechanisms for Disaggregated LLM Inference
Architecture", section 5.2):

* ``prefill``: remote prefills of other engines' sessions; no new session;
* ``decode``: sessions are bound to it; their rounds prefill locally or remotely as the
  policy routes them (AMPD's Alg. 1);
* ``mixed``: sessions are bound to it and every round of theirs prefills on it, chunked
  beside their decodes, as a colocated vLLM runs;
* ``unified``: sessions are bound to it and other engines' sessions may prefill on it -
  DynaServe's unified engines, which run any part of any request (rounds.split_point).

An engine that changes role keeps the work it has: a running round finishes where it
is. Until it has, the engine is *draining* the role it left - Arrow's transitional
pools: P->D (decode now, prefills still running) and D->P (prefill now, decodes still
running). Sessions bound to an engine that stopped decoding are bound elsewhere at
their next round (rounds.core), and that round reaches their KV from the engine that
holds it over NIXL instead of recomputing their history.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal, get_args

Role = Literal["prefill", "decode", "mixed", "unified"]
ROLES: tuple[Role, ...] = get_args(Role)


@dataclass(frozen=True, slots=True)
class Assignment:
    worker_id: str
    role: Role
    since: float = 0.0  # when it took this role
    draining: Role | None = None  # the role it left, while work of that kind still runs on it

    @property
    def binds(self) -> bool:
        """New sessions may be bound to it."""
        return self.role != "prefill"

    @property
    def prefills_remote(self) -> bool:
        """Other engines' sessions may prefill on it."""
        return self.role in ("prefill", "unified")

    @property
    def colocates(self) -> bool:
        """Its sessions' rounds all prefill on it."""
        return self.role == "mixed"

    @property
    def pool(self) -> str:
        """Arrow's pool: P, D, M (mixed), or a transition P->D / D->P while it drains."""
        name = {"prefill": "P", "decode": "D", "mixed": "M", "unified": "U"}
        if self.draining is None or self.draining == self.role:
            return name[self.role]
        return f"{name[self.draining]}->{name[self.role]}"


def move(current: Assignment, role: Role, now: float, busy: bool) -> Assignment:
    """``current`` taking ``role`` at ``now``; ``busy``: it still runs work of its old role.
    Moving back to the role it is draining ends the transition (the work is its own again)."""
    if role == current.role:
        return current
    draining = current.role if busy and current.draining != role else None
    return Assignment(current.worker_id, role, now, draining)


def busy(prefilling: bool, decoding: bool) -> set[Role]:
    """The roles whose work an engine still has: other engines' prefills queued or running
    on it (prefill, unified), requests of its own sessions running (decode, mixed, unified)."""
    out: set[Role] = {"prefill", "unified"} if prefilling else set()
    return out | {"decode", "mixed", "unified"} if decoding else out


def settle(current: Assignment, busy_with: Iterable[Role]) -> Assignment:
    """The transition is over once no work of the role it left runs on it."""
    if current.draining is not None and current.draining not in set(busy_with):
        return replace(current, draining=None)
    return current


def initial(worker_id: str, capability: str, now: float = 0.0) -> Assignment:
    """The role an engine starts in: the one it registered with (``both`` engines decode)."""
    role: Role = "prefill" if capability == "prefill" else "decode"
    return Assignment(worker_id, role, now)


def counts(assignments: Iterable[Assignment]) -> dict[Role, int]:
    """Engines in each role."""
    out = dict.fromkeys(ROLES, 0)
    for a in assignments:
        out[a.role] += 1
    return out
