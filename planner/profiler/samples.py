"""What the profiler measures: the grid it samples and the samples it takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Clock = Literal["client", "engine"]  # whose clock times a first token (planner.profiler.measure)


@dataclass(frozen=True)
class Grid:
    """Where to sample the engine; points beyond its max_model_len or KV cache are skipped.

    ``prefill_hist`` values and ``transfer_tokens - 1`` should be multiples of the
    engine's KV block size (so prefix-cache hits are exact); ``prefill_incr`` should
    stay within ``max_num_batched_tokens`` (so a prefill is one step).
    """

    prefill_hist: tuple[int, ...] = (0, 512, 2048, 8192)
    prefill_incr: tuple[int, ...] = (16, 64, 256, 1024, 4096)
    decode_batch: tuple[int, ...] = (1, 4, 16, 64)
    decode_context: tuple[int, ...] = (128, 1024, 4096)
    transfer_tokens: tuple[int, ...] = (257, 1025, 4097, 16385)
    repeats: int = 3  # samples per prefill / transfer point (median)
    decode_repeats: int = 1  # batches per decode point (each already a median over its streams)
    steady_tokens: int = 16  # decode steps timed per stream once the whole batch decodes
    min_chunk_tokens: int = 512  # smallest per-step token budget assumed when sizing max_tokens

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.decode_repeats < 1 or self.steady_tokens < 2 or self.min_chunk_tokens < 1:
            raise ValueError("repeats and decode_repeats must be >= 1, steady_tokens >= 2")
        sizes = [*self.prefill_incr, *self.decode_batch, *self.decode_context, *self.transfer_tokens]
        if any(n < 1 for n in sizes) or any(n < 0 for n in self.prefill_hist):
            raise ValueError("grid sizes must be positive (prefill_hist may be 0)")


class PrefillSample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    l_hist: int = Field(ge=0, description="tokens the prefix cache supplied")
    l_incr: int = Field(ge=1, description="tokens computed")
    seconds: float = Field(description="modelled seconds: median TTFT (by the measurement's clock) x speed")
    runs: list[float] = Field(default_factory=list, description="every run, modelled seconds")


class DecodeSample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch: int = Field(ge=1)
    context: float = Field(ge=0, description="total KV tokens of the batch, mean over the timed steps")
    seconds: float = Field(description="modelled seconds per decode step")
    prompt_tokens: int = Field(ge=1, description="prompt length of each stream")


class TransferSample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: int = Field(ge=1, description="tokens whose KV moved")
    seconds: float = Field(description="modelled T_kv: the pull by the engine's clock, else total - recompute")
    total_seconds: float = Field(description="decode request's TTFT with the hand-off, modelled")
    recompute_seconds: float = Field(description="T_pre(tokens - 1, 1) on the decode engine, modelled")
    clock: Clock = Field(default="client", description="engine: vllm:nixl_xfer_time_seconds; client: the difference")


class Measurements(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    prefill_url: str | None = None
    model_name: str
    max_model_len: int
    speed: float = Field(gt=0)
    clock: Clock = "client"
    kv_capacity_tokens: int | None = None
    kv_capacity_source: str = "unknown"
    block_size: int | None = None
    api_overhead_seconds: float | None = Field(
        default=None,
        description="median client-clock minus engine-clock first-token time (HTTP and API server), modelled",
    )
    repeats: int = 1
    measured_at: str = ""
    prefill: list[PrefillSample] = Field(default_factory=list)
    decode: list[DecodeSample] = Field(default_factory=list)
    transfer: list[TransferSample] = Field(default_factory=list)


DEFAULT_GRID = Grid()
