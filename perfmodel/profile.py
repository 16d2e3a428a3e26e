"""Profiles: the performance model of one model on one GPU type at one TP degree.

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving", section 3) needs three cost functions,
all piecewise alpha-beta:

* ``T_pre(l_hist, l_incr; theta)`` - prefill of ``l_incr`` new tokens after ``l_hist``
  cached ones (initial prefill: ``l_hist = 0``);
* ``T_dec(b, context; theta)`` - one decode step of a batch of ``b`` sequences whose
  KV caches hold ``context`` tokens in total;
* ``T_kv(tokens; theta_src, theta_dst)`` - moving KV between two replicas.

theta is (GPU type, TP degree). All three are assembled from four fitted pieces that
mirror what a forward pass does, so one step that mixes prefill chunks and decodes
(continuous batching with chunked prefill) is costed by the same functions:

* ``forward(tokens)``: the dense/MoE layers over all tokens in the step, including the
  weight reads, tensor-parallel all-reduces and the fixed per-step overhead;
* ``prefill_attention(pairs)``: causal attention of new tokens against history and
  each other, pairs = l_incr * l_hist + l_incr * (l_incr + 1) / 2;
* ``context_read(tokens)``: reading cached KV (decode attention, history for prefill);
* ``kv_transfer(bytes)``: one link's transfer of KV between replicas.

The profile file holds the fitted pieces and everything they were derived from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from perfmodel.memory import MemoryPlan
from perfmodel.piecewise import PiecewiseLinear
from perfmodel.specs import GPUSpec, ModelSpec

PROFILES_DIR = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = "llama-3.1-8b_h100_tp1"


class Efficiency(BaseModel):
    """Discount factors applied to published peaks (the multi-vendor P/D paper, Eq. 2 and 5: lambda, alpha, beta)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    compute: float = Field(gt=0, le=1, description="fraction of peak FLOP/s in large GEMMs")
    compute_fp8: float | None = Field(
        default=None, gt=0, le=1, description="fraction of FP8 peak in FP8 GEMMs; None: as `compute`"
    )
    attention: float = Field(gt=0, le=1, description="fraction of peak FLOP/s in prefill attention")
    memory: float = Field(gt=0, le=1, description="fraction of HBM bandwidth achieved")
    interconnect: float = Field(gt=0, le=1, description="fraction of NVLink bandwidth in all-reduce")
    network: float = Field(gt=0, le=1, description="fraction of NIC bandwidth in KV transfer")
    allreduce_latency_s: float = Field(ge=0, description="fixed cost of one all-reduce")
    step_overhead_s: float = Field(ge=0, description="scheduler, sampling and launch cost per step")
    kv_transfer_latency_s: float = Field(ge=0, description="fixed cost of one KV transfer")
    source: str

    def compute_for(self, dtype: str) -> float:
        """The GEMM efficiency for weights of ``dtype``: FP8 GEMMs reach a different share of
        their (twice as high) peak than BF16 ones."""
        return self.compute_fp8 if dtype == "fp8" and self.compute_fp8 is not None else self.compute


class CostPieces(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    forward: PiecewiseLinear
    prefill_attention: PiecewiseLinear
    context_read: PiecewiseLinear
    kv_transfer: PiecewiseLinear  # between servers: over each rank's NIC
    kv_transfer_node: PiecewiseLinear | None = None  # within a server (NVLink); None: as between them


class Profile(BaseModel):
    """One performance-model file; see the module docstring for the cost functions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    name: str
    method: Literal["roofline", "measured"]
    model: ModelSpec
    gpu: GPUSpec
    tp: int = Field(ge=1)
    memory: MemoryPlan
    kv_capacity_tokens: int = Field(ge=0)
    efficiency: Efficiency | None = Field(default=None, description="roofline inputs, if derived")
    pieces: CostPieces
    notes: str = ""

    @property
    def theta(self) -> tuple[str, int]:
        return (self.gpu.name, self.tp)

    def with_step_costs_scaled(self, factor: float) -> Profile:
        """This profile with every step's time times ``factor`` (forward, attention, KV
        reads; KV transfers as they were): a profile mispriced on purpose, to show a step
        sizer correcting it (perfmodel.step_correction)."""
        p = self.pieces
        pieces = p.model_copy(update={"forward": p.forward.scaled(factor),
                                      "prefill_attention": p.prefill_attention.scaled(factor),
                                      "context_read": p.context_read.scaled(factor)})  # fmt: skip
        return self.model_copy(update={"pieces": pieces, "notes": f"{self.notes} step costs x{factor:g}".strip()})

    def step_time(self, prefills: Iterable[tuple[int, int]] = (), decode_contexts: Sequence[int] = ()) -> float:
        """Seconds for one engine step.

        ``prefills`` are (l_hist, l_incr) chunks, ``decode_contexts`` the context length
        of each sequence decoding one token in the same step.
        """
        tokens = len(decode_contexts)
        pairs = 0.0
        read = float(sum(decode_contexts))
        for hist, incr in prefills:
            tokens += incr
            pairs += incr * hist + incr * (incr + 1) / 2
            read += hist
        if tokens == 0:
            return 0.0
        p = self.pieces
        return p.forward(tokens) + p.prefill_attention(pairs) + p.context_read(read)

    def t_pre(self, l_hist: int, l_incr: int) -> float:
        """AMPD's T_pre(l_hist, l_incr; theta): one step prefilling l_incr tokens."""
        return self.step_time(prefills=[(l_hist, l_incr)])

    def t_pre_chunked(self, l_hist: int, l_incr: int, chunk: int) -> float:
        """T_pre of an engine that prefills at most ``chunk`` tokens of a request a step
        (vLLM's ``long_prefill_token_threshold``; 0 = one step): the sum of its chunks."""
        if chunk <= 0 or l_incr <= chunk:
            return self.t_pre(l_hist, l_incr)
        return sum(self.t_pre(l_hist + done, min(chunk, l_incr - done)) for done in range(0, l_incr, chunk))

    def t_dec(self, batch: int, context: int) -> float:
        """AMPD's T_dec(b; theta), with the batch's total context as a second argument."""
        if batch <= 0:
            return 0.0
        return self.pieces.forward(batch) + self.pieces.context_read(context)

    def decode_steps(self, batch: int, context: int, steps: int) -> list[float]:
        """Cumulative end times of ``steps`` decode steps of a fixed batch whose context
        grows by ``batch`` tokens a step: ``[T_dec(b, C), T_dec(b, C) + T_dec(b, C + b), ...]``."""
        forward = self.pieces.forward(batch)
        return list(accumulate(map(forward.__add__, self.pieces.context_read.along(context, batch, steps))))

    def dump(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=2) + "\n")


def t_kv(tokens: int, src: Profile, dst: Profile, same_node: bool = False) -> float:
    """AMPD's T_kv(l; theta_src, theta_dst): seconds to move the KV of ``tokens`` tokens.

    Every TP rank holds a slice of the KV heads and ranks transfer in parallel, one link
    each, so min(tp_src, tp_dst) links share the bytes (the resharding of the multi-vendor P/D paper,
    section III, done by the side with fewer ranks). The slower end bounds the time. Between
    engines of one server (``same_node``) the path is the server's GPU interconnect
    (NVLink), where both profiles price it; else each rank's NIC.
    """
    if tokens <= 0:
        return 0.0
    links = min(src.tp, dst.tp)
    per_link = tokens * src.model.kv_bytes_per_token / links
    if same_node and src.pieces.kv_transfer_node is not None and dst.pieces.kv_transfer_node is not None:
        return max(src.pieces.kv_transfer_node(per_link), dst.pieces.kv_transfer_node(per_link))
    return max(src.pieces.kv_transfer(per_link), dst.pieces.kv_transfer(per_link))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (``llama-3.1-70b_h20_tp4``) or any profile file by path."""
    path = Path(name_or_path)
    if not path.exists():
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
        raise FileNotFoundError(f"no profile {name_or_path!r}; shipped profiles: {known}")
    return Profile.model_validate_json(path.read_text())


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
