"""One engine process's state, the worker: its config, its engine, and vLLM's request rules.

The routers (workers.sim.{operations,tokenization,generation,handoff}) reach it through
one dependency, ``WorkerDep``, which reads ``request.app.state.worker`` once a request.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import Depends, Request

from perfmodel.profile import Profile
from rounds.engine.request import RemotePrefill
from rounds.engine.request import Request as EngineRequest
from rounds.engine.scheduler import Scheduler, SchedulerConfig
from surface.kv_events import DEFAULT_SEED, BlockHasher
from surface.registry import Role, node_name
from surface.wire import PULL_FIELDS, SPLIT_AT, pull_params
from workers.sim import protocol as p
from workers.sim.engine import AsyncEngine, RequestStream
from workers.sim.kv_events import KVEventPublisher
from workers.sim.kv_transfer import KVSideChannel
from workers.sim.metrics import EngineMetrics
from workers.sim.responder import Responder
from workers.sim.tokenizer import Tokenizer

# vLLM bounds characters per token by its vocabulary's longest token; the sim's pieces
# are words of any length, so it takes a bound real text stays far below.
MAX_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class WorkerConfig:
    profile: Profile
    role: Role = "both"
    port: int = 8100
    advertise_host: str = "127.0.0.1"  # where peers reach this worker's side channel
    node: str = ""  # the server it runs on; "": surface.registry.node_name's (AMPD_NODE, else the advertised host)
    served_model_name: str | None = None
    max_model_len: int | None = None
    speed: float = 1.0
    scheduler: SchedulerConfig = SchedulerConfig()
    default_output_tokens: int = 32
    enable_prompt_tokens_details: bool = False
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    redis_url: str | None = None  # register in this Redis and heartbeat (surface.registry)
    redis_prefix: str = "ampd"
    # KV events as vLLM publishes them (workers.sim.kv_events): on, at these ports (0: any free)
    kv_events: bool = True
    kv_events_port: int = 0
    kv_events_replay_port: int = 0
    kv_hash_seed: str = DEFAULT_SEED  # vLLM's NONE_HASH seed (surface.kv_events.hash_seed)

    @property
    def url(self) -> str:
        return f"http://{self.advertise_host}:{self.port}"

    @property
    def node_name(self) -> str:
        return self.node or node_name(self.advertise_host)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.profile.model.hf_id


class SimWorker:
    """Everything one engine process holds; the app reads it through ``worker()``."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        # Blocks hashed as vLLM hashes them, so that what it publishes is what vLLM would.
        hasher = BlockHasher(config.kv_hash_seed)
        self.scheduler = Scheduler(config.profile, config.scheduler, hasher, record_kv_events=config.kv_events)
        capacity = self.scheduler.kv.num_blocks * self.scheduler.kv.block_size
        self.max_model_len = config.max_model_len or config.profile.model.max_model_len
        if capacity < self.max_model_len:
            raise ValueError(
                f"max_model_len {self.max_model_len} is larger than the KV cache ({capacity} tokens); "
                "lower --max-model-len or give the cache more blocks"
            )
        self.tokenizer = Tokenizer(config.profile.model.vocab_size)
        self.responder = Responder(self.tokenizer, config.default_output_tokens)
        self.metrics = EngineMetrics(self.scheduler, config.model_name, self.max_model_len)
        self.side_channel = KVSideChannel()
        self.kv_events = (
            KVEventPublisher(config.advertise_host, config.kv_events_port, config.kv_events_replay_port)
            if config.kv_events
            else None
        )
        self.engine = AsyncEngine(
            self.scheduler,
            self.metrics,
            self.side_channel,
            speed=config.speed,
            kv_load_failure_policy=config.kv_load_failure_policy,
            node=config.node_name,
            kv_events=self.kv_events,
        )

    def check_model(self, model: str | None) -> None:
        if model and model != self.config.model_name:
            raise p.EngineError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {self.config.model_name}.",
                "NotFoundError",
                "model",
            )

    def encode_prompt(self, text: str) -> list[int]:
        """vLLM 0.32's check before tokenizing (vllm/renderers/params.py): a prompt longer
        in characters than max_model_len tokens could ever hold is refused unread."""
        limit, chars = self.max_model_len, self.max_model_len * MAX_CHARS_PER_TOKEN
        if len(text) > chars:
            raise p.EngineError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{len(text)} characters (more than {chars} characters, which is the upper bound for {limit} "
                f"input tokens). Please reduce the length of the input prompt. "
                f"(parameter=input_text, value={len(text)})",
                param="input_text",
            )
        return self.tokenizer.encode(text)

    def max_tokens_for(self, prompt_len: int, requested: int | None, param: str) -> int:
        """vLLM's length rules: reject an over-long prompt, clamp max_tokens to the context.
        vLLM stops tokenizing one token past the limit, hence "at least"."""
        limit = self.max_model_len
        if prompt_len > limit:
            raise p.EngineError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"at least {limit + 1} input tokens, which exceeds this limit even without any output tokens. "
                f"Please reduce the length of the input prompt. (parameter=input_tokens, value={limit + 1})",
                param="input_tokens",
            )
        if requested is not None and requested > limit:
            raise p.EngineError(
                400,
                f"{param}={requested} cannot be greater than max_model_len={limit}. Please request fewer "
                f"output tokens. (parameter={param}, value={requested})",
                param=param,
            )
        room = limit - prompt_len
        if room < 1:
            raise p.EngineError(400, f"{param} must be at least 1, got 0. (parameter={param}, value=0)", param=param)
        return room if requested is None else min(requested, room)

    def transfer_role(self, params: dict[str, Any] | None) -> tuple[bool, RemotePrefill | None]:
        """Read vLLM's ``kv_transfer_params``: (prefill-only?, where to pull KV from)."""
        if not params:
            return False, None
        role = self.config.role
        if params.get("do_remote_decode"):
            if role == "decode":
                raise p.EngineError(400, "this worker is a decode worker (kv_consumer); it does not produce KV")
            return True, None
        if not params.get("do_remote_prefill"):
            return False, None
        if role == "prefill":
            raise p.EngineError(400, "this worker is a prefill worker (kv_producer); it does not pull KV")
        missing = [k for k in PULL_FIELDS if params.get(k) in (None, "")]
        if missing:
            raise p.EngineError(400, f"kv_transfer_params lacks {', '.join(missing)}", param="kv_transfer_params")
        block_ids = params["remote_block_ids"]
        if block_ids and isinstance(block_ids[0], list):  # one list per KV-cache group (vLLM >= 0.12)
            if len(block_ids) != 1:
                raise p.EngineError(400, "only one KV-cache group is supported", param="kv_transfer_params")
            block_ids = block_ids[0]
        num_tokens = params.get("remote_num_tokens")
        return False, RemotePrefill(
            engine_id=str(params["remote_engine_id"]),
            host=str(params["remote_host"]),
            port=int(params["remote_port"]),
            request_id=str(params["remote_request_id"]),
            block_ids=tuple(int(b) for b in block_ids),
            num_tokens=None if num_tokens is None else int(num_tokens),
        )

    def split_prompt(self, params: dict[str, Any] | None, prompt_ids: list[int]) -> list[int]:
        """The prompt a prefill-only request computes: the whole, or its first ``split_at``
        tokens (surface.wire.SPLIT_AT) - whole blocks, as the decode engine pulls them."""
        if not params or not params.get("do_remote_decode") or params.get(SPLIT_AT) is None:
            return prompt_ids
        split_at, block = params[SPLIT_AT], self.config.scheduler.block_size
        if not isinstance(split_at, int) or isinstance(split_at, bool) or split_at < 1 or split_at % block:
            raise p.EngineError(
                400, f"{SPLIT_AT} must be a positive multiple of the KV block size ({block}), got {split_at!r}",
                param="kv_transfer_params",
            )  # fmt: skip
        return prompt_ids[:split_at]

    def kv_params_out(self, request: EngineRequest, held: tuple[int, ...]) -> dict[str, Any] | None:
        if not held:
            return None
        c = self.config
        # As vLLM's connector: the tokens whose KV the blocks hold - the prompt, and a request allowed
        # more than one token also its output but the last (a hand-off mid-decode, DynaServe's alpha).
        return pull_params(c.engine_id, request.request_id, c.advertise_host, c.port, list(held),
                           request.num_computed_tokens, c.profile.tp)  # fmt: skip

    def usage(self, stream: RequestStream, completion_tokens: int) -> p.Usage:
        request = stream.request
        cached = None
        if self.config.enable_prompt_tokens_details:
            cached = request.num_cached_tokens + stream.pulled_tokens
        return p.Usage(request.num_prompt_tokens, completion_tokens, cached)


def worker(request: Request) -> SimWorker:
    """The app's worker, resolved once a request (streams take it as an argument, not per chunk)."""
    return request.app.state.worker


WorkerDep = Annotated[SimWorker, Depends(worker)]
