"""Multi-round workload traces: the JSONL format, and generators shaped like the paper's.

One line per session (an agent run or an iterative RAG query)::

    {"session_id": "tb-0", "arrival_s": 0.41, "rounds": [
        {"input_tokens": 812, "output_tokens": 47, "tool_calls": 1, "tool_latency_s": 0.9},
        {"input_tokens": 655, "output_tokens": 52, "tool_calls": 0, "tool_latency_s": 0.0}]}

A session of an agent population also says which of its first round's leading tokens
other sessions share (``prefix``: segments in order, each a ``key`` naming its content
and its ``tokens``; a session's first ``sum(tokens)`` input tokens are those segments,
and two sessions share a block of them where their segment keys agree up to the segment
the block ends in)::

    {"session_id": "tb-7", "arrival_s": 3.2, "prefix": [
        {"key": "agent-2/system", "tokens": 1830}, {"key": "tenant-4/agent-2/tools", "tokens": 9120}],
     "rounds": [{"input_tokens": 11152, "output_tokens": 61, "tool_calls": 1, "tool_latency_s": 1.1}, ...]}

``input_tokens`` is what the round adds to the conversation before it prefills (the
whole prompt in the first round, the tool results after that), so the round's prompt
is every earlier round's input and output plus its own input. The session waits
``tool_latency_s`` after a round that called tools, then sends the next round; the last
round calls none.

The generators match the means of Table 1 of AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving",
section 7.1): rounds per session, prefill length and decode length. We read the prefill
length as the whole prompt of each LLM call, averaged over calls, and the decode length
as the output of each call. The other reading, the tokens each round *adds*, cannot be
what the paper ran: its Figure 4 breakdown runs Llama-3.1-70B at 2 sessions/s, and
HotpotQA would then need about 9,400 prefill tokens/s (1.3 PFLOPS) from 8 H20s that
have 1.2 PFLOPS between them, and GAIA sessions would end near 74k tokens.

The paper gives one number for two unknowns: the first prompt and what each later round
adds (the tool results). We give both the same mean, the split that assumes least;
``Workload.mean_added_tokens`` solves for it (with prefix caching, it is also what an
incremental prefill computes). The spreads are our choice too:

* token counts are log-normal with sigma 0.6 (prompt) and 0.5 (output): LLM prompt and
  output lengths are right-skewed with a long tail (the shape measured in ShareGPT,
  BurstGPT and Splitwise's traces), and a log-normal keeps every length positive;
* rounds: ToolBench and GAIA are agent runs that stop when the task is done, so their
  count is 1 + Poisson (ToolBench) or 1 + negative binomial (GAIA, whose long tasks
  make the spread larger than the mean); HotpotQA and DuReader are iterative RAG with
  exactly three retrievals, so three rounds (Appendix B);
* tool latency is log-normal around the tool's kind: 1 s for ToolBench's REST APIs,
  2 s for GAIA's browsing and code, 0.2 s for a retrieval (not in the paper);
* agent populations (``with_agents``): K agent types, each with a system prompt
  (1-3k tokens) and tool schemas (4-22k), so 5-25k tokens of instructions before the
  task - the range of production agents' prompts (a coding agent's tools and rules run
  10-20k) - and T tenants; a session is drawn from a type and a tenant, and its first
  round starts with that shared prefix;
* sessions arrive as a Poisson process at ``rate`` per second (section 7.1), or at a
  rate that varies in time (``Shape``: a ramp, a burst, a day-shaped curve, and a mix
  that shifts from one workload to another) - the load a fixed deployment serves worst.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator


class TraceRound(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    input_tokens: int = Field(ge=1, description="prompt tokens this round adds (the whole prompt in round 1)")
    output_tokens: int = Field(ge=1)
    tool_calls: int = Field(default=0, ge=0, description="tool calls that end this round")
    tool_latency_s: float = Field(default=0.0, ge=0, description="time until the tool results are in")


class SharedPrefix(BaseModel):
    """One segment of the leading tokens a session shares with others (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(min_length=1, description="names the segment's content: equal keys, equal tokens")
    tokens: int = Field(ge=1)


class TraceSession(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    session_id: str = Field(min_length=1)
    arrival_s: float = Field(ge=0)
    rounds: list[TraceRound] = Field(min_length=1)
    prefix: list[SharedPrefix] = Field(default=[], description="the first round's leading tokens other sessions share")

    @model_validator(mode="after")
    def _last_round_ends(self) -> TraceSession:
        if self.rounds[-1].tool_calls:
            raise ValueError(f"session {self.session_id}: the last round calls tools nobody answers")
        if self.prefix_tokens >= self.rounds[0].input_tokens:
            raise ValueError(f"session {self.session_id}: its shared prefix leaves its first round no own tokens")
        return self

    @property
    def prefix_tokens(self) -> int:
        return sum(segment.tokens for segment in self.prefix)

    @property
    def context_tokens(self) -> int:
        """Tokens of the whole conversation after its last round."""
        return sum(r.input_tokens + r.output_tokens for r in self.rounds)


def load_trace(path: Path) -> list[TraceSession]:
    """Sessions of a JSONL trace, by arrival time. Errors name the offending line."""
    sessions: list[TraceSession] = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            session = TraceSession.model_validate_json(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from exc
        if session.session_id in seen:
            raise ValueError(f"{path}:{number}: duplicate session id {session.session_id!r}")
        seen.add(session.session_id)
        sessions.append(session)
    if not sessions:
        raise ValueError(f"{path}: no sessions")
    return sorted(sessions, key=lambda s: s.arrival_s)


def write_trace(sessions: Iterable[TraceSession], path: Path) -> None:
    """One JSON line per session; a session without a shared prefix is written without the field."""
    path.write_text("".join(s.model_dump_json(exclude=None if s.prefix else {"prefix"}) + "\n" for s in sessions))


@dataclass(frozen=True)
class Workload:
    """The shape of one trace family: Table 1's means plus our spreads (module docstring)."""

    name: str
    mean_rounds: float
    mean_prompt_tokens: float  # Table 1's prefill length: a call's whole prompt
    mean_output_tokens: float
    mean_tool_latency_s: float
    rounds_dispersion: float = 1.0  # variance / mean of (rounds - 1); 0 = fixed count
    input_sigma: float = 0.6
    output_sigma: float = 0.5
    tool_sigma: float = 0.5

    @property
    def mean_added_tokens(self) -> float:
        """The mean tokens the first round's prompt and every later round's tool results
        have, so that the mean prompt over calls is ``mean_prompt_tokens``. Call k of a
        session prompts with k additions and k - 1 outputs, so the mean prompt over calls
        is a + (a + o) * c, with c the mean number of earlier calls, E[R(R-1)/2] / E[R]."""
        extra = self.mean_rounds - 1
        earlier = (self.rounds_dispersion * extra + self.mean_rounds**2 - self.mean_rounds) / (2 * self.mean_rounds)
        added = (self.mean_prompt_tokens - self.mean_output_tokens * earlier) / (1 + earlier)
        if added <= 0:
            raise ValueError(f"{self.name}: outputs alone outgrow a mean prompt of {self.mean_prompt_tokens} tokens")
        return added


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("toolbench", 3.96, 703.79, 50.39, 1.0),
        Workload("gaia", 11.32, 6161.02, 528.76, 2.0, rounds_dispersion=3.0),
        Workload("hotpotqa", 3.0, 1569.8, 80.03, 0.2, rounds_dispersion=0.0),
        Workload("dureader", 3.0, 3081.23, 150.10, 0.2, rounds_dispersion=0.0),
    ]
}


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    """Log-normal draws with the given *mean* (not median)."""
    return rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, size)


def _rounds(rng: np.random.Generator, w: Workload, size: int) -> np.ndarray:
    extra = w.mean_rounds - 1
    if w.rounds_dispersion == 0:
        return np.full(size, round(w.mean_rounds), dtype=int)
    if w.rounds_dispersion == 1:
        return 1 + rng.poisson(extra, size)
    p = 1 / w.rounds_dispersion  # negative binomial with mean `extra`, variance extra/p
    return 1 + rng.negative_binomial(extra * p / (1 - p), p, size)


def _sessions(rng: np.random.Generator, workload: Workload, arrivals: Sequence[float], first: int = 0):
    """Sessions of ``workload`` arriving at ``arrivals`` (ids numbered from ``first``)."""
    n = len(arrivals)
    counts = _rounds(rng, workload, n)
    total = int(counts.sum())
    inputs = np.maximum(1, _lognormal(rng, workload.mean_added_tokens, workload.input_sigma, total).round())
    outputs = np.maximum(1, _lognormal(rng, workload.mean_output_tokens, workload.output_sigma, total).round())
    tools = _lognormal(rng, workload.mean_tool_latency_s, workload.tool_sigma, total)
    out, k = [], 0
    for i in range(n):
        rounds = []
        for j in range(counts[i]):
            last = j == counts[i] - 1
            rounds.append(
                TraceRound(
                    input_tokens=int(inputs[k]),
                    output_tokens=int(outputs[k]),
                    tool_calls=0 if last else 1,
                    tool_latency_s=0.0 if last else round(float(tools[k]), 4),
                )
            )
            k += 1
        session_id = f"{workload.name}-{first + i}"
        out.append(TraceSession(session_id=session_id, arrival_s=round(float(arrivals[i]), 4), rounds=rounds))
    return out


def generate(workload: Workload, sessions: int, rate: float, seed: int = 0) -> list[TraceSession]:
    """``sessions`` sessions of ``workload`` arriving as a Poisson process at ``rate``/s."""
    if sessions < 1 or rate <= 0:
        raise ValueError("need at least one session and a positive rate")
    rng = np.random.default_rng(seed)
    return _sessions(rng, workload, np.cumsum(rng.exponential(1 / rate, sessions)))


@dataclass(frozen=True)
class Agents:
    """A population of ``types`` agent types serving ``tenants`` tenants (module docstring):
    each type has its system prompt and its tool schemas, whose lengths are drawn once
    per type; with more than one tenant, each tenant brings its own tool schemas (its
    own APIs) of the type's length."""

    types: int
    tenants: int = 1
    system_tokens: tuple[int, int] = (1000, 3000)  # the range a type's system prompt is drawn from
    tool_tokens: tuple[int, int] = (4000, 22000)  # the range its tool schemas are drawn from

    def __post_init__(self) -> None:
        if self.types < 1 or self.tenants < 1:
            raise ValueError("an agent population needs at least one agent type and one tenant")


def with_agents(sessions: Sequence[TraceSession], agents: Agents, seed: int = 0) -> list[TraceSession]:
    """``sessions``, each drawn from an agent type and a tenant (uniformly): its first round
    starts with that type's system prompt and that tenant's tool schemas for it, which
    every session of the type (and tenant) shares. The draws take a random stream of
    their own, so the sessions' own tokens, rounds and arrivals stay what they were."""
    rng = np.random.default_rng([seed, 1])
    system = rng.integers(agents.system_tokens[0], agents.system_tokens[1] + 1, agents.types)
    tools = rng.integers(agents.tool_tokens[0], agents.tool_tokens[1] + 1, agents.types)
    kinds, tenants = rng.integers(0, agents.types, len(sessions)), rng.integers(0, agents.tenants, len(sessions))
    out = []
    for session, k, t in zip(sessions, kinds, tenants, strict=True):
        owner = f"tenant-{t}/agent-{k}" if agents.tenants > 1 else f"agent-{k}"
        prefix = [SharedPrefix(key=f"agent-{k}/system", tokens=int(system[k])),
                  SharedPrefix(key=f"{owner}/tools", tokens=int(tools[k]))]  # fmt: skip
        first = session.rounds[0]
        head = first.model_copy(update={"input_tokens": first.input_tokens + sum(p.tokens for p in prefix)})
        out.append(session.model_copy(update={"rounds": [head, *session.rounds[1:]], "prefix": prefix}))
    return out


ShapeKind = Literal["ramp", "burst", "diurnal", "mix"]
SHAPES: tuple[ShapeKind, ...] = get_args(ShapeKind)


@dataclass(frozen=True)
class Shape:
    """Load that varies in time over ``duration_s``, between ``low`` and ``high`` sessions/s:

    * ``ramp``: from low to high, linearly;
    * ``burst``: low, with high for the middle fifth;
    * ``diurnal``: a day in one duration - low at its ends, high at its middle (a raised cosine);
    * ``mix``: the rate ramps as ``ramp`` does while the sessions shift from one workload
      to another (each session is the second with a probability that grows from 0 to 1).
    """

    kind: ShapeKind
    duration_s: float
    low: float
    high: float

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or not 0 < self.low <= self.high:
            raise ValueError("a shape needs a positive duration and rates 0 < low <= high")

    def rate(self, t: float) -> float:
        x = min(max(t / self.duration_s, 0.0), 1.0)
        if self.kind in ("ramp", "mix"):
            return self.low + (self.high - self.low) * x
        if self.kind == "burst":
            return self.high if 0.4 <= x < 0.6 else self.low
        return self.low + (self.high - self.low) * (1 - math.cos(2 * math.pi * x)) / 2


def generate_shaped(
    workload: Workload, shape: Shape, seed: int = 0, to_workload: Workload | None = None
) -> list[TraceSession]:
    """Sessions arriving as a Poisson process whose rate follows ``shape`` (drawn by thinning
    one at its ``high`` rate). A ``mix`` shifts from ``workload`` to ``to_workload``."""
    if shape.kind == "mix" and to_workload is None:
        raise ValueError("a mix needs the workload it shifts to")
    rng = np.random.default_rng(seed)
    candidates = np.cumsum(rng.exponential(1 / shape.high, int(shape.duration_s * shape.high * 1.5) + 16))
    candidates = candidates[candidates < shape.duration_s]
    keep = rng.random(len(candidates)) * shape.high < np.array([shape.rate(t) for t in candidates])
    arrivals = candidates[keep]
    if not len(arrivals):
        raise ValueError("the shape gives no arrival: raise its rates or its duration")
    if shape.kind != "mix":
        return _sessions(rng, workload, arrivals)
    assert to_workload is not None
    second = rng.random(len(arrivals)) < arrivals / shape.duration_s
    sessions = _sessions(rng, workload, arrivals[~second]) + _sessions(rng, to_workload, arrivals[second])
    return sorted(sessions, key=lambda s: s.arrival_s)


def respace(sessions: list[TraceSession], rate: float, seed: int = 0) -> list[TraceSession]:
    """The same sessions, in order, arriving as a Poisson process at ``rate``/s instead."""
    if rate <= 0:
        raise ValueError("the arrival rate must be positive")
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, len(sessions)))
    return [s.model_copy(update={"arrival_s": round(float(t), 4)}) for s, t in zip(sessions, arrivals, strict=True)]


def rounds_per_session(sessions: Sequence[TraceSession]) -> float:
    """The mean rounds of a session: sessions per second times this is rounds per second,
    the load the elastic controller measures."""
    return sum(len(s.rounds) for s in sessions) / len(sessions)


def summarize(sessions: list[TraceSession]) -> dict[str, float]:
    """Table 1's columns for a trace, to compare a generated one with the paper."""
    prompts, added, outputs = [], [], []
    for session in sessions:
        context = 0
        for r in session.rounds:
            prompts.append(context + r.input_tokens)
            added.append(r.input_tokens)
            outputs.append(r.output_tokens)
            context += r.input_tokens + r.output_tokens
    span = sessions[-1].arrival_s - sessions[0].arrival_s
    return {
        "sessions": len(sessions),
        "mean_rounds": len(prompts) / len(sessions),
        "mean_prompt_tokens": float(np.mean(prompts)),
        "mean_added_tokens": float(np.mean(added)),
        "mean_output_tokens": float(np.mean(outputs)),
        "arrival_rate": (len(sessions) - 1) / span if span > 0 else math.inf,
    }


def subsample(sessions: list[TraceSession], every: int, offset: int = 0) -> Iterator[TraceSession]:
    """Every ``every``-th session: the share of the trace one of ``every`` replicas gets."""
    return (s for i, s in enumerate(sessions) if i % every == offset)
