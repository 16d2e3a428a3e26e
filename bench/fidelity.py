"""`ampd bench fidelity --engine vllm`: the simulator against real vLLM engines.

Every verdict the simulator gives is only as good as its agreement with a real engine.
Here two vLLM engines (its CPU build, each pinned to a core of its own) serve a
dummy-weight Llama whose steps take tens of milliseconds on one core, through the
gateway, under each policy (``coloc``: both engines colocated; ``ampd`` and ``disagg``:
one prefill and one decode engine over NIXL; ``dynaserve``: both unified, their steps
sized to the target the gateway assigns - the same two engines, their roles the
gateway's). A multi-round agent trace is replayed live (bench.replay, in vLLM's
dialect) at a light and a loaded rate, several runs each; then the same rounds - their
token counts as the engines counted them - are simulated with the engines' profile,
measured on those engines by ``ampd profile --worker``, on the same deployment and
with vLLM's own scheduler settings. The rows put live and simulated side by side:
per-round TTFT (initial and incremental), per-token gap, and SLO attainment under each
ITL rule.

Where they part, the simulator's engine (rounds.engine.scheduler) or its cost model is
wrong, or the live run had what the simulator does not model: on this machine the
gateway, Redis and the load generator share the engines' two cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import string
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from ampd.local_redis import delete_prefix, ensure_redis, free_port
from ampd.processes import Child, spawn, spawn_gateway, wait_healthy
from ampd.stack import STATE_DIR
from bench.replay import LiveRound, VllmDialect, replay_sessions
from perfmodel.profile import Profile, load_profile
from perfmodel.slo import ITL_RULES, SLO, ItlRule, derived_slo
from perfmodel.specs import GPUSpec, ModelSpec
from planner.profiler import profile_worker
from planner.profiler.samples import Grid
from planner.simulator import Pool, SimConfig, Simulation
from planner.trace import WORKLOADS, TraceRound, TraceSession, generate, load_trace, write_trace
from rounds.engine.scheduler import SchedulerConfig
from surface.registry import heartbeat_client, live_workers

PREFIX = "ampd-bench-fidelity"
ROOT = Path(__file__).resolve().parents[1]  # the repository's root: what a report's paths are relative to
POLICIES = ("coloc", "ampd", "disagg", "dynaserve")
# How each policy uses the two engines (rounds.roles): ``coloc`` both decoding, each
# prefilling its own sessions; ``dynaserve`` both unified, any part of any round on
# either; the rest engine 0 prefilling and engine 1 decoding.
ROLES = {"coloc": ("decode", "decode"), "dynaserve": ("unified", "unified")}
DISAGGREGATED = ("prefill", "decode")
# The ITL rule a policy steers by (the gateway's --itl-slo-metric): ``dynaserve`` sizes
# steps under the P95 rule (rounds.policies.step_target), the rest steer by the mean.
ITL_RULE: dict[str, ItlRule] = {"dynaserve": "p95"}
LOADS = ("light", "loaded")
# The engines' model: small enough that a step takes tens of milliseconds on one core,
# bytes for tokens (workers.vllm.tiny_model: what a reply says is the tokens it was).
MODEL_SIZES = {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 2, "intermediate": 1408}
MAX_MODEL_LEN = 4096
# vLLM 0.32's own defaults on its CPU build (vllm/engine/arg_utils.py, vllm/platforms/cpu.py),
# written out so that the simulator's engine runs the same: 2,048 batched tokens and 128
# sequences a step, 128-token KV blocks, chunked prefill, no async scheduling on a CPU.
SCHEDULER = SchedulerConfig(block_size=128, max_num_seqs=128, max_num_batched_tokens=2048)
VLLM_ARGS = (
    "--load-format", "dummy", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
    "--block-size", str(SCHEDULER.block_size), "--max-num-batched-tokens", str(SCHEDULER.max_num_batched_tokens),
    "--max-num-seqs", str(SCHEDULER.max_num_seqs),
)  # fmt: skip
# Where the profiler samples a CPU engine: prompts within the model's length, batches whose
# prompts it prefills in seconds, and KV hand-offs of whole 128-token blocks plus one.
CPU_GRID = Grid(prefill_hist=(0, 512, 1536), prefill_incr=(16, 64, 256, 1024), decode_batch=(1, 4, 16),
                decode_context=(128, 512, 1536), transfer_tokens=(129, 513, 1537), repeats=3,
                steady_tokens=16, min_chunk_tokens=512)  # fmt: skip
# One x86-64 core as the profile's hardware: what the profile records, and the transfer
# price the fit falls back on without a prefill engine (the bench always has one).
HOST_CPU = GPUSpec(
    name="CPU", memory_bytes=2**30, hbm_bandwidth=20e9, peak_flops={"fp32": 100e9}, intra_node_bandwidth=10e9,
    network_bandwidth=5e9, source="one x86-64 core of vLLM's CPU build; nominal: the bench measures the engine",
)  # fmt: skip
METRICS = ("ttft_initial_p50", "ttft_initial_p95", "ttft_incremental_p50", "ttft_incremental_p95", "gap_p50",
           "gap_p95", *(f"attainment_{rule}" for rule in ITL_RULES))  # fmt: skip


@dataclass(frozen=True)
class FidelitySetup:
    sessions: int = 24
    light_rate: float = 0.05  # sessions per second
    loaded_rate: float = 0.2
    runs: int = 3
    workload: str = "toolbench"
    seed: int = 0
    policies: tuple[str, ...] = POLICIES
    loads: tuple[str, ...] = LOADS
    profile: Path | None = None  # measured before; else measured on the engines first
    out_dir: Path = STATE_DIR / "fidelity"
    redis_url: str = "redis://127.0.0.1:6379/11"
    vllm_python: str = ""  # the interpreter vLLM is installed in (`ampd worker vllm --python`)
    vllm_options: tuple[str, ...] = ()  # appended to VLLM_ARGS (``-O0``: a start without torch.compile)

    def rate(self, load: str) -> float:
        return self.light_rate if load == "light" else self.loaded_rate


def model_spec(folder: Path) -> ModelSpec:
    """The served test model as the performance model describes one (fp32 weights and KV)."""
    config = json.loads((folder / "config.json").read_text())
    return ModelSpec(
        name="tiny-llama-cpu", hf_id=repo_path(folder), num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"], num_attention_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
        intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"], max_model_len=MAX_MODEL_LEN,
        weight_dtype="fp32", kv_dtype="fp32", source="workers.vllm.tiny_model, the fidelity bench's sizes",
    )  # fmt: skip


def build_model(folder: Path) -> Path:
    """The test model's folder: a byte-level tokenizer (no merges), so any letters a reply
    is sampled from are the tokens it is made of."""
    from workers.vllm.tiny_model import SPECIALS, build

    if not (folder / "config.json").exists():
        build(folder, vocab_size=len(SPECIALS) + 256, **MODEL_SIZES)
    return folder


def letter_ids(folder: Path) -> tuple[int, ...]:
    """The ids of the lowercase letters and the space (byte-level: "Ġ"), which replies are sampled from."""
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    return tuple(sorted(vocab[c] for c in [*string.ascii_lowercase, "Ġ"]))


@contextlib.contextmanager
def bench_redis(url: str, folder: Path) -> Iterator[str]:
    """The Redis at ``url``, else a private one in ``folder``; the bench's keys cleared before (what
    an earlier run left: its sessions' rounds, its engines' roles) and after."""
    redis = ensure_redis(url, folder / "redis")
    delete_prefix(redis.url, PREFIX)
    try:
        yield redis.url
    finally:
        delete_prefix(redis.url, PREFIX)
        redis.stop()


@dataclass
class Engines:
    """The two engines, each on a core of its own: ``[0]`` on core 0, ``[1]`` on core 1."""

    children: list[Child]
    urls: list[str]
    worker_ids: list[str]

    def stop(self) -> None:
        for child in self.children:
            child.stop(timeout_s=60)


@contextlib.contextmanager
def engines(
    vllm_python: str,
    model: Path,
    profile: str,
    redis_url: str,
    log_dir: Path,
    cores: Sequence[int] = (0, 1),
    options: Sequence[str] = (),
    vllm_args: Sequence[str] = VLLM_ARGS,
    vllm_options: Sequence[str] = (),
) -> Iterator[Engines]:
    """`ampd worker vllm` engines registered as ``both`` with ``profile``, one pinned to each of
    ``cores``; ``options`` go to `ampd worker vllm`, ``vllm_args`` and then ``vllm_options`` to vLLM."""
    children, urls = [], []
    try:
        for core in cores:
            port = free_port()
            command = [
                "worker", "vllm", "--model", str(model), "--served-model-name", "tiny-llama", "--role", "both",
                "--host", "127.0.0.1", "--advertise-host", "127.0.0.1", "--port", str(port),
                "--side-channel-port", str(free_port()), "--kv-buffer-device", "cpu", "--profile", profile,
                "--redis-url", redis_url, "--redis-prefix", PREFIX, "--ready-timeout", "900", *options,
                *(["--python", vllm_python] if vllm_python else []), "--", *vllm_args, *vllm_options,
            ]  # fmt: skip
            env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1"}
            children.append(spawn(f"vllm-{core}", port, command, log=log_dir / f"vllm-{core}.log", cpu=core, env=env))
            urls.append(f"http://127.0.0.1:{port}")
        ids = _wait_registered(urls, redis_url, children, timeout_s=900)
        yield Engines(children, urls, ids)
    finally:
        for child in children:
            child.stop(timeout_s=60)


def _wait_registered(urls: list[str], redis_url: str, children: list[Child], timeout_s: float) -> list[str]:
    async def listed() -> dict[str, str]:
        redis = heartbeat_client(redis_url)
        try:
            return {info.url: info.worker_id for info in await live_workers(redis, PREFIX)}
        finally:
            await redis.aclose()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [c.name for c in children if c.process.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited before serving; see its log")
        found = asyncio.run(listed())
        if all(u in found for u in urls):
            return [found[u] for u in urls]
        time.sleep(2)
    raise RuntimeError(f"the engines did not register within {timeout_s:.0f} s")


def set_roles(redis_url: str, policy: str, worker_ids: list[str]) -> None:
    """The engines' roles under ``policy`` (``ROLES``)."""
    from gateway.elastic_live import set_role

    async def assign() -> None:
        redis = heartbeat_client(redis_url)
        try:
            for worker_id, role in zip(worker_ids, ROLES.get(policy, DISAGGREGATED), strict=True):
                await set_role(redis, PREFIX, worker_id, role)
        finally:
            await redis.aclose()

    asyncio.run(assign())


@contextlib.contextmanager
def gateway(policy: str, slo: SLO, redis_url: str, log_dir: Path) -> Iterator[str]:
    port = free_port()
    options = ["--redis-url", redis_url, "--redis-prefix", PREFIX, "--policy", policy,
               "--ttft-slo", repr(slo.ttft_s), "--itl-slo", repr(slo.itl_s),
               "--itl-slo-metric", ITL_RULE.get(policy, "mean")]  # fmt: skip
    child = spawn_gateway("gateway", port, options, log_dir / f"gateway-{policy}.log")
    try:
        if wait_healthy([child], timeout_s=60, path="/readyz") is not None:
            raise RuntimeError(f"the gateway did not come up; see {log_dir}/gateway-{policy}.log")
        yield child.url
    finally:
        child.stop()


def observed_trace(trace: Sequence[TraceSession], records: dict[str, list[dict]]) -> list[TraceSession]:
    """The trace's sessions with each round's tokens as the engines counted them: a round
    adds its prompt less the last prompt and reply (the chat template's markers included),
    and writes the reply it wrote. Arrivals and tool latencies are the trace's."""
    out = []
    for session in trace:
        done = records.get(session.session_id, [])
        if len(done) != len(session.rounds):
            raise RuntimeError(f"{session.session_id}: {len(done)} rounds recorded for its {len(session.rounds)}: "
                               f"{json.dumps(done)[:2000]}")  # fmt: skip
        rounds, context = [], 0
        for spec, record in zip(session.rounds, done, strict=True):
            prompt = record["l_hist"] + record["l_incr"]
            rounds.append(TraceRound(input_tokens=max(1, prompt - context), output_tokens=record["completion_tokens"],
                                     tool_calls=spec.tool_calls, tool_latency_s=spec.tool_latency_s))  # fmt: skip
            context = prompt + record["completion_tokens"]
        out.append(session.model_copy(update={"rounds": rounds}))
    return out


async def _records(url: str, sessions: Sequence[TraceSession]) -> dict[str, list[dict]]:
    async with httpx.AsyncClient(timeout=30) as client:
        out = {}
        for session in sessions:
            response = await client.get(f"{url}/v1/sessions/{session.session_id}")
            out[session.session_id] = response.json()["rounds"] if response.status_code == 200 else []
        return out


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def live_metrics(rounds: Sequence[LiveRound], records: dict[str, list[dict]]) -> dict[str, float | None]:
    """A live run's figures, taken where the simulator takes them: each round's TTFT and SLO
    verdicts as the gateway recorded them (from the round's task to its first token at the
    gateway, judged by the gateway against the same SLO), the gaps between the tokens the
    client received. The client's TTFT (the gateway's own work before the round's task
    included) is kept beside them, with no simulated counterpart."""
    done = [r for rs in records.values() for r in rs]
    initial = [r["ttft_s"] for r in done if r["kind"] == "initial" and r["ttft_s"] is not None]
    later = [r["ttft_s"] for r in done if r["kind"] == "incremental" and r["ttft_s"] is not None]
    gaps = [g for r in rounds for g in r.gaps]
    client = [r.ttft_s for r in rounds]
    out: dict[str, float | None] = {
        "ttft_initial_p50": _percentile(initial, 50), "ttft_initial_p95": _percentile(initial, 95),
        "ttft_incremental_p50": _percentile(later, 50), "ttft_incremental_p95": _percentile(later, 95),
        "gap_p50": _percentile(gaps, 50), "gap_p95": _percentile(gaps, 95),
        "client_ttft_p50": _percentile(client, 50), "client_ttft_p95": _percentile(client, 95),
    }  # fmt: skip
    for rule in ITL_RULES:
        out[f"attainment_{rule}"] = sum(r["slo_met"][rule] for r in done) / len(done)
    return out


def sim_metrics(sim: Simulation, slo: SLO) -> dict[str, float | None]:
    """The simulated run's figures, taken as the live ones are."""
    records = sim.records
    initial = [r.ttft_s for r in records if not r.incremental and r.ttft_s is not None]
    later = [r.ttft_s for r in records if r.incremental and r.ttft_s is not None]
    out: dict[str, float | None] = {
        "ttft_initial_p50": _percentile(initial, 50), "ttft_initial_p95": _percentile(initial, 95),
        "ttft_incremental_p50": _percentile(later, 50), "ttft_incremental_p95": _percentile(later, 95),
        "gap_p50": _percentile(sim.token_gaps, 50), "gap_p95": _percentile(sim.token_gaps, 95),
    }  # fmt: skip
    for rule in ITL_RULES:
        out[f"attainment_{rule}"] = sum(r.slo_met[rule] for r in records) / len(records)
    return out


def sim_config(policy: str, profile: Profile, slo: SLO) -> SimConfig:
    """The live deployment, simulated: two engines colocated or unified, or one prefill and
    one decode; steered by the policy's ITL rule, as its gateway was."""
    rule = ITL_RULE.get(policy, "mean")
    if policy in ROLES:
        return SimConfig(decode=Pool(profile, 2), prefill=None, slo=slo, policy=policy, scheduler=SCHEDULER,
                         itl_rule=rule)  # fmt: skip
    return SimConfig(decode=Pool(profile, 1), prefill=Pool(profile, 1), slo=slo, policy=policy, scheduler=SCHEDULER,
                     itl_rule=rule)  # fmt: skip


def rows(results: dict[tuple[str, str], list[tuple[dict, dict]]]) -> list[dict]:
    """One row per (policy, load, metric): the means over the runs, live and simulated, the
    error - (sim - live) / live for times, sim - live for attainment - and the live spread."""
    out = []
    for (policy, load), runs in results.items():
        for metric in METRICS:
            live = [r[0][metric] for r in runs if r[0][metric] is not None]
            sim = [r[1][metric] for r in runs if r[1][metric] is not None]
            if not live or not sim:
                continue
            lv, sv = statistics.mean(live), statistics.mean(sim)
            error = sv - lv if metric.startswith("attainment") else (sv - lv) / lv if lv else None
            out.append({"policy": policy, "load": load, "metric": metric, "live": lv, "sim": sv, "error": error,
                        "live_min": min(live), "live_max": max(live), "runs": len(live)})  # fmt: skip
    return out


def run_fidelity(console: Console, setup: FidelitySetup, out: Path | None) -> int:
    setup.out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(setup.out_dir / "model")
    try:
        with bench_redis(setup.redis_url, setup.out_dir) as redis_url:
            profile_path = setup.profile or measure_profile(console, setup, model, redis_url)
            profile = load_profile(profile_path)
            slo = derived_slo(profile)
            console.print(f"SLO: TTFT {slo.ttft_s * 1e3:.0f} ms, ITL {slo.itl_s * 1e3:.1f} ms (5x unloaded)")
            runs = compare(console, setup, model, profile_path, slo, redis_url)
    except RuntimeError as exc:
        console.print(f"[red]{exc}[/red]")
        return 1
    report(console, setup_dict(setup), profile_path, runs, out)
    return 0


def resimulate(console: Console, previous: Path, out: Path | None) -> int:
    """A fidelity report's live runs simulated again (the simulator changed, the live rounds did not).
    A run's trace path is taken relative to the report's folder, so a report and its traces move together."""
    document = json.loads(previous.read_text())
    runs = [Run(r["policy"], r["load"], r["index"], r["live"], previous.parent / r["trace"]) for r in document["runs"]]
    profile = Path(document["profile"])
    if not profile.exists():  # recorded from outside the repository (by its name): beside the report
        profile = previous.parent / profile.name
    report(console, document["setup"], profile, runs, out or previous)
    return 0


def report(console: Console, setup: dict, profile_path: Path, runs: Sequence[Run], out: Path | None) -> None:
    profile = load_profile(profile_path)
    slo = derived_slo(profile)
    with console.status("simulating the live runs' rounds"):
        sims = simulated(runs, profile, slo)
    results: Results = {}
    for run, sim in zip(runs, sims, strict=True):
        results.setdefault((run.policy, run.load), []).append((run.live, sim))
    table_rows = rows(results)
    console.print(_table(table_rows))
    document = {"engine": "vllm", "profile": repo_path(profile_path), "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
                "setup": setup, "scheduler": asdict(SCHEDULER), "rows": table_rows,
                "runs": [{"policy": r.policy, "load": r.load, "index": r.index, "trace": _relative(r.trace, out),
                          "live": r.live, "sim": sim} for r, sim in zip(runs, sims, strict=True)]}  # fmt: skip
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(document, indent=2) + "\n")
        console.print(f"wrote {out}")


def _relative(trace: Path, out: Path | None) -> str:
    """A run's trace as the report names it: from the report's folder (see ``resimulate``)."""
    return os.path.relpath(trace.resolve(), out.resolve().parent) if out is not None else str(trace.resolve())


def repo_path(path: str | Path) -> str:
    """A path as a report records it, naming nothing of the machine it ran on: relative to the
    repository's root when under it, else the file's name alone. Symbolic links are followed
    up to the file, not to it (a venv's ``bin/python`` stays itself)."""
    if not str(path):
        return ""
    where = Path(os.path.realpath(Path(path).absolute().parent)) / Path(path).name
    return os.path.relpath(where, ROOT) if where.is_relative_to(ROOT) else where.name


def setup_dict(setup: Any) -> dict:
    """A bench's setup dataclass as its report records it (paths and the vLLM interpreter as ``repo_path``
    names them)."""
    return {k: repo_path(v) if isinstance(v, Path) or k == "vllm_python" else v for k, v in asdict(setup).items()}


def measure_profile(console: Console, setup: FidelitySetup, model: Path, redis_url: str) -> Path:
    """``ampd profile --worker`` on the engines: engine 1 timed, and its KV hand-off from engine 0."""
    path = setup.out_dir / "tiny-llama-cpu_measured.json"
    with console.status("starting two vLLM engines to profile them"), \
            engines(setup.vllm_python, model, "llama-3.1-8b_h100_tp1", redis_url, setup.out_dir,
                    vllm_options=setup.vllm_options) as e:  # fmt: skip
        console.print(f"profiling {e.urls[1]} (its KV hand-off from {e.urls[0]})")
        set_roles(redis_url, "disagg", e.worker_ids)
        asyncio.run(profile_worker(e.urls[1], prefill_url=e.urls[0], model=model_spec(model), gpu=HOST_CPU,
                                   out_path=path, grid=CPU_GRID, clock="engine", progress=console.print,
                                   measurements_out=setup.out_dir / "measurements.json"))  # fmt: skip
    console.print(f"wrote {path}")
    return path


@dataclass(frozen=True)
class Run:
    """One live run: its figures, and its rounds as the engines counted them (to simulate)."""

    policy: str
    load: str
    index: int
    live: dict[str, float | None]
    trace: Path  # the observed trace (JSONL)


def compare(
    console: Console, setup: FidelitySetup, model: Path, profile_path: Path, slo: SLO, redis_url: str
) -> list[Run]:
    """Every policy, load and run live on the engines; each run's rounds (the observed trace, and
    the gateway's records) kept beside its figures."""
    letters = letter_ids(model)
    traces = setup.out_dir / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    with console.status("starting two vLLM engines"), \
            engines(setup.vllm_python, model, str(profile_path), redis_url, setup.out_dir,
                    vllm_options=setup.vllm_options) as e:  # fmt: skip
        for policy in setup.policies:
            set_roles(redis_url, policy, e.worker_ids)
            with gateway(policy, slo, redis_url, setup.out_dir) as url:
                for load in setup.loads:
                    for run in range(setup.runs):
                        trace = [s.model_copy(update={"session_id": f"{policy}-{load}-{run}-{s.session_id}"})
                                 for s in generate(WORKLOADS[setup.workload], setup.sessions, setup.rate(load),
                                                   seed=setup.seed + run)]  # fmt: skip
                        salt = f"{policy}:{load}:{run}:{time.time()}"
                        live, records = _live_run(url, trace, letters, salt)
                        path = traces / f"{policy}-{load}-{run}.jsonl"
                        write_trace(observed_trace(trace, records), path)
                        path.with_suffix(".records.json").write_text(json.dumps(records) + "\n")
                        runs.append(Run(policy, load, run, live, path))
                        console.print(f"{policy} {load} run {run + 1}: live {_brief(live)}")
    return runs


def _live_run(
    url: str, trace: list[TraceSession], letters: tuple[int, ...], salt: str
) -> tuple[dict[str, float | None], dict[str, list[dict]]]:
    """The trace replayed live; its figures, and the rounds as the gateway recorded them."""
    rounds, _ = asyncio.run(replay_sessions(url, trace, 1.0, dialect=VllmDialect(letters, salt), tolerate=False))
    records = asyncio.run(_records(url, trace))
    served = {r["decode_worker"] for rs in records.values() for r in rs}
    if not all(w.startswith("vllm-") for w in served):
        raise RuntimeError(f"rounds were served by {sorted(served)}, not by the vLLM engines")
    return live_metrics(rounds, records), records


def simulated(runs: Sequence[Run], profile: Profile, slo: SLO) -> list[dict[str, float | None]]:
    """Each run's rounds through the simulator on the live deployment, in the runs' order."""
    out = []
    for run in runs:
        sim = Simulation(sim_config(run.policy, profile, slo), load_trace(run.trace), keep_gaps=True)
        sim.run()
        out.append(sim_metrics(sim, slo))
    return out


Results = dict[tuple[str, str], list[tuple[dict, dict]]]  # (policy, load) -> (live, simulated) per run


def _brief(m: dict) -> str:
    def ms(key: str) -> str:
        return "-" if m[key] is None else f"{m[key] * 1e3:.0f}"

    return (f"TTFT p50 {ms('ttft_initial_p50')}/{ms('ttft_incremental_p50')} ms, gap p95 {ms('gap_p95')} ms, "
            f"attainment {m['attainment_mean']:.0%}/{m['attainment_p95']:.0%}/{m['attainment_max']:.0%}")  # fmt: skip


def _table(table_rows: list[dict]) -> Table:
    table = Table("policy", "load", "metric", "live", "simulated", "error", "live spread")
    for r in table_rows:
        attainment = r["metric"].startswith("attainment")
        show = _percent if attainment else _ms
        error = f"{r['error'] * 100:+.1f} points" if attainment else f"{r['error']:+.1%}"
        table.add_row(r["policy"], r["load"], r["metric"], show(r["live"]), show(r["sim"]), error,
                      f"{show(r['live_min'])} - {show(r['live_max'])}")  # fmt: skip
    return table


def _percent(v: float) -> str:
    return f"{v:.1%}"


def _ms(v: float) -> str:
    return f"{v * 1e3:,.1f} ms"
