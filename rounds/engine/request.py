"""A request as the engine core sees it: token ids, progress and KV blocks."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass(frozen=True)
class RemotePrefill:
    """Where this request's prompt KV was computed (vLLM's kv_transfer_params, decode side)."""

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int | None = None  # prompt tokens it holds KV for (vLLM's remote_num_tokens); None: all

    def covers(self, num_prompt_tokens: int) -> int:
        """The prompt tokens whose KV is pulled from it; the decode engine prefills the rest
        itself (a split request: DynaServe's beta micro-request, see rounds.split_point)."""
        return num_prompt_tokens if self.num_tokens is None else min(self.num_tokens, num_prompt_tokens)


@dataclass
class Request:
    """One generation. ``output_plan`` is what the model will say, token by token.

    The plan ends with EOS unless the engine's responder cut it; generation stops at
    the end of the plan (``stop``) or after ``max_tokens`` tokens (``length``).
    ``do_remote_decode`` marks a prefill-only request whose blocks are kept for a
    remote decoder; ``remote_prefill`` a request whose prompt KV is pulled first.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_plan: list[int]
    max_tokens: int
    arrival_time: float
    do_remote_decode: bool = False
    remote_prefill: RemotePrefill | None = None
    cache_salt: str | None = None  # vLLM's: enters the hash of the prompt's first block

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission (reported in usage)
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[Hashable] = field(default_factory=list)  # one per full block (the KV cache's hasher)
    num_cached_blocks: int = 0  # leading blocks already published in the prefix cache

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("empty prompt")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_decoding(self) -> bool:
        """Has output and only its last sampled token left to compute."""
        return bool(self.output_token_ids) and len(self.token_ids) - self.num_computed_tokens == 1

    @property
    def remaining_output_tokens(self) -> int:
        return min(self.max_tokens, len(self.output_plan)) - len(self.output_token_ids)

    def append_planned(self, n: int) -> list[int]:
        """Sample the next ``n`` tokens of the plan (the caller checks there are that many)."""
        start = len(self.output_token_ids)
        tokens = self.output_plan[start : start + n]
        self.output_token_ids += tokens
        self.token_ids += tokens
        return tokens

    def stop_status(self) -> RequestStatus | None:
        """The finished status after the latest token, or None to keep going."""
        said = len(self.output_token_ids)
        if said >= self.max_tokens:  # vLLM checks the length cap first
            return RequestStatus.FINISHED_LENGTH
        if said >= len(self.output_plan):
            return RequestStatus.FINISHED_STOPPED
        return None
