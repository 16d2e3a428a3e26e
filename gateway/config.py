"""The gateway's configuration: one validated object, built by the CLI or by tests."""

from __future__ import annotations

import secrets
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from perfmodel.profile import Profile
from perfmodel.slo import ALPHA, BETA, SLO, ItlRule, derived_slo
from rounds.elastic import RolePlan
from rounds.placement import Placement
from rounds.policies import POLICIES
from surface.redis_address import RedisAddress
from surface.registry import Role
from tools_sandbox.registry import TOOLS


class StaticWorker(BaseModel):
    """A worker the gateway is told about instead of finding it in the registry (it runs no
    split requests: engines register that they do)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    role: Role = "both"
    profile: str = Field(default="llama-3.1-8b_h100_tp1", description="shipped profile name or file")
    speed: float = Field(default=1.0, gt=0)
    splits: bool = Field(
        default=False, description="prefills a prompt's head alone (split_at), as the GPU-free engine does"
    )


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="redis://... for one server, redis+sentinel://... for a primary Sentinel manages "
        "(surface.redis_address)",
    )
    redis_failover_wait_s: float = Field(
        default=30.0,
        ge=0,
        description="with Sentinel: how long a round's writes wait for a primary to take them (a failover) "
        "before they are dropped as in an outage (gateway.state.failover)",
    )
    redis_replica_ack_ms: int = Field(
        default=500,
        ge=0,
        description="with Sentinel: how long a round's writes wait for a replica's acknowledgement (WAIT); "
        "0: not asked",
    )
    key_prefix: str = Field(default="ampd", description="prefix of every Redis key; isolates deployments")
    replica_id: str = Field(default_factory=lambda: secrets.token_hex(6))

    policy: str = "ampd"
    placement: Placement = Field(
        default="memory",
        description="where sessions bind and remote prefills go: memory, ampd, dynamo-kv, llmd-prefix or "
        "sglang-cache (rounds.placement)",
    )
    alpha: float = Field(default=ALPHA, gt=0, description="TTFT slack factor of Alg. 1")
    beta: float = Field(default=BETA, gt=0, description="ITL slack factor of Alg. 1")
    reorder_window: int = Field(default=3, ge=1, le=6, description="w of Alg. 2 (window and postponement cap)")
    stats_window_s: int = Field(default=10, ge=1, description="windowed TTFT/ITL statistics span")
    ttft_slo_s: float | None = Field(default=None, gt=0, description="default: scale x unloaded TTFT")
    itl_slo_s: float | None = Field(default=None, gt=0, description="default: scale x unloaded ITL")
    slo_scale: float = Field(default=5.0, gt=0)
    itl_slo_metric: ItlRule = Field(
        default="mean",
        description="how a round's ITL meets its SLO (mean, p95 or max gap); tail-aware policies read it",
    )
    routing_seed: int | None = None
    role_plan: RolePlan | None = Field(
        default=None, description="an elastic pool's planned split by load (`ampd plan --policy elastic`)"
    )

    prefill_slots: int = Field(default=1, ge=1, description="prefill tasks in flight per worker")
    max_queue: int = Field(default=1024, ge=1, description="queued prefills per worker before 429")
    session_ttl_s: int = Field(default=3600, ge=1)
    api_keys: tuple[str, ...] = Field(default=(), description="accepted keys, plain or 'sha256:<hex>'; none = open")
    api_keys_file: Path | None = Field(
        default=None,
        description="more keys, one a line ('KEY [tenant=NAME]'), re-read when the file changes or on SIGHUP",
    )
    access_log: str = Field(
        default="ampd-access.log", description="a JSON line per request to this file; '-': stderr; 'off': none"
    )
    access_log_max_bytes: int = Field(default=100 * 2**20, ge=1024, description="size at which the file rotates")
    access_log_backups: int = Field(default=5, ge=1, description="rotated files kept")
    max_body_bytes: int = Field(default=8 * 2**20, ge=1024)
    request_timeout_s: float = Field(default=600.0, gt=0)
    scrape_interval_s: float = Field(default=1.0, gt=0)
    static_workers: tuple[StaticWorker, ...] = ()
    served_model_names: tuple[str, ...] = Field(
        default=(),
        description="more names clients may call the engines' model by (as vLLM's --served-model-name); "
        "/v1/models lists them first",
    )
    server_tools: tuple[str, ...] = Field(
        default=tuple(TOOLS), description="server-side tools requests may enable with `server_tools`"
    )
    migration_limit: int = Field(
        default=3,
        ge=0,
        description="times a round's stream may move off a lost decode worker (gateway.engines.migration)",
    )
    max_tool_rounds: int = Field(default=8, ge=1, description="server tool rounds per request before it stops")
    log_content: bool = Field(
        default=False,
        description="log each exchange's messages and reply (logger ampd.content); off, no prompt "
        "text reaches a log or a span",
    )

    @field_validator("redis_url")
    @classmethod
    def _readable_redis_url(cls, value: str) -> str:
        RedisAddress.parse(value)
        return value

    @field_validator("server_tools")
    @classmethod
    def _known_tools(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = set(value) - set(TOOLS)
        if unknown:
            raise ValueError(f"unknown server tools {sorted(unknown)}; known: {', '.join(TOOLS)}")
        return value

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown policy {value!r}; one of {', '.join(POLICIES)}")
        return value

    @model_validator(mode="after")
    def _plan_needs_elastic(self) -> GatewayConfig:
        if self.role_plan is not None and POLICIES[self.policy].elastic is None:
            raise ValueError(f"a role plan steers an elastic policy, not {self.policy!r}")
        return self

    @property
    def kv_index(self) -> bool:
        """Whether the replica subscribes to the engines' KV events and indexes the prefix
        blocks each holds (gateway.engines.kv_index): where its placement reads them. Under
        ``memory`` nothing reads them, and their ingestion would cost every request's CPU."""
        return self.placement != "memory"

    def slo(self, profile: Profile, speed: float) -> SLO:
        """The SLO rounds decoded on an engine of ``profile`` at ``speed`` are judged by: the
        thresholds given, else the scale times that engine's unloaded latencies."""
        derived = derived_slo(profile, self.slo_scale).scaled(speed)
        return SLO(self.ttft_slo_s or derived.ttft_s, self.itl_slo_s or derived.itl_s)
