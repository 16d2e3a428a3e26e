"""`ampd bench ...`: every benchmark command, registered here; each one's work is its own
module of bench, imported when the command runs (so ``ampd --help`` stays quick)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress, TextColumn, TimeElapsedColumn

from ampd import terminal
from ampd.planning import ItlRuleOption, ModelOption, PolicyOption, ProfilesOption, fail, ms, profile_book, slo_for
from perfmodel.catalog import GPUS
from perfmodel.profile import DEFAULT_PROFILE
from perfmodel.slo import DEFAULT_SCALE

bench_app = typer.Typer(help="Benchmarks.", no_args_is_help=True)
console = terminal.console()
# The shared-prefix agent traces of the placement benches (planner.trace.Agents).
AgentsOption = Annotated[int, typer.Option(min=1, help="agent types")]
TenantsOption = Annotated[int, typer.Option(min=1, help="tenants, each with its own tool schemas")]


@bench_app.command("engine")
def bench_engine(
    profile: str = DEFAULT_PROFILE,
    speed: float = 20.0,
    tolerance: Annotated[float, typer.Option(help="allowed ITL excess over the model")] = 0.05,
    output_tokens: int = 200,
    port: int = 8190,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Concurrent streams one sim worker sustains on one core within the ITL tolerance."""
    from bench.engine import run_engine_bench

    raise typer.Exit(run_engine_bench(console, profile, speed, tolerance, output_tokens, port, out))


@bench_app.command("gateway")
def bench_gateway(
    speed: float = 1.0,
    levels: Annotated[str, typer.Option(help="concurrent streams, comma-separated")] = "1,64,256",
    requests: Annotated[int, typer.Option(help="requests per stream at each level")] = 5,
    output_tokens: int = 32,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Latency the gateway adds over calling a worker directly, and the routing decision's cost."""
    from bench.gateway import run_gateway_bench

    level_list = [int(x) for x in levels.split(",")]
    raise typer.Exit(run_gateway_bench(console, speed, level_list, requests, output_tokens, out))


@bench_app.command("overhead")
def bench_overhead(
    arms: Annotated[
        str,
        typer.Option(
            help="comma-separated, of direct, ampd (ampd-xN: N gateway processes), relay (a bare Python "
            "relay on ampd's stack), litellm, vllm-router"
        ),
    ] = "direct,ampd,relay,litellm,vllm-router",
    levels: Annotated[str, typer.Option(help="concurrent streams, comma-separated")] = "1,64,256",
    requests: Annotated[int, typer.Option(help="requests per stream at each level")] = 5,
    output_tokens: int = 32,
    tool_rounds: Annotated[
        int, typer.Option(help="an agent's tool calls and results every request carries before its own message")
    ] = 0,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here (and Markdown beside)")] = None,
) -> None:
    """Latency ampd, a bare relay, LiteLLM's proxy and vllm-router add over calling one worker directly."""
    from bench.overhead import run_overhead_bench

    level_list = [int(x) for x in levels.split(",")]
    code = run_overhead_bench(console, arms.split(","), level_list, requests, output_tokens, tool_rounds, out)
    raise typer.Exit(code)


@bench_app.command("load")
def bench_load(
    agents: Annotated[int, typer.Option(help="concurrent agent sessions")] = 1000,
    minutes: Annotated[float, typer.Option(help="how long the gateway run lasts")] = 10.0,
    baseline_minutes: Annotated[float, typer.Option(help="how long the direct run (the baseline) lasts")] = 3.0,
    speed: Annotated[float, typer.Option(help="GPU-free workers run this many times faster")] = 10.0,
    policy: Annotated[str, typer.Option(help="gateway policy; coloc keeps the comparison to the gateway")] = "coloc",
    rounds: int = 4,
    output_tokens: int = 20,
    think_min_s: float = 4.0,
    think_max_s: float = 12.0,
    gateway_processes: Annotated[int, typer.Option(min=1, help="processes of the gateway (`--processes`)")] = 1,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Agent sessions for minutes through the gateway: lost rounds, errors, memory, added latency."""
    from bench.load import LoadShape, run_load_bench

    shape = LoadShape(rounds=rounds, output_tokens=output_tokens, think_s=(think_min_s, think_max_s))
    raise typer.Exit(
        run_load_bench(console, agents, minutes, baseline_minutes, speed, policy, shape, out, gateway_processes)
    )


@bench_app.command("chaos")
def bench_chaos(
    agents: Annotated[int, typer.Option(help="concurrent agent sessions")] = 24,
    minutes: float = 5.0,
    interval_s: Annotated[float, typer.Option(help="seconds between faults")] = 15.0,
    down_s: Annotated[float, typer.Option(help="seconds a killed part stays down")] = 3.0,
    speed: Annotated[float, typer.Option(help="GPU-free workers run this many times faster")] = 2.0,
    rounds: Annotated[int, typer.Option(help="model calls per session")] = 3,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
    sentinel: Annotated[
        bool, typer.Option(help="Redis as a primary, a replica and three sentinels; its fault kills the primary")
    ] = False,
) -> None:
    """Agent sessions while decode/prefill/tools workers, Redis and gateway replicas are killed in turn."""
    from bench.chaos import run_chaos_bench

    raise typer.Exit(run_chaos_bench(console, agents, minutes, interval_s, down_s, speed, rounds, out,
                                     sentinel=sentinel))  # fmt: skip


@bench_app.command("run")
def bench_run(
    trace: Annotated[Path | None, typer.Option(help="JSONL trace to replay (else one is generated)")] = None,
    workload: Annotated[str, typer.Option(help="trace to generate: toolbench, gaia, hotpotqa or dureader")] = (
        "toolbench"
    ),
    sessions: Annotated[int, typer.Option(help="sessions to generate")] = 120,
    rate: Annotated[
        float | None, typer.Option(help="sessions per modelled second (a given trace is re-spaced to it)")
    ] = None,
    policy: PolicyOption = "ampd",
    itl_slo_metric: ItlRuleOption = "mean",
    profile: str = "llama-3.1-70b_h20_tp4",
    speed: Annotated[float, typer.Option(help="GPU-free workers run this many times faster")] = 4.0,
    prefill_replicas: int = 1,
    decode_replicas: int = 1,
    pool: Annotated[
        int, typer.Option(help="engines of an elastic policy or dynaserve (with 0 prefill and 0 decode replicas)")
    ] = 0,
    role_plan: Annotated[
        str | None, typer.Option(envvar="AMPD_ROLE_PLAN", help="the pool's split by load, JSON (`ampd plan`)")
    ] = None,
    seed: int = 0,
    port: Annotated[int, typer.Option(help="gateway port; the workers take free ones")] = 8400,
    redis_url: Annotated[str, typer.Option(envvar="REDIS_URL")] = "redis://127.0.0.1:6379/0",
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Replay a trace live (gateway + GPU-free workers), next to the simulator's prediction."""
    from pydantic import TypeAdapter

    from bench.run import LiveSetup, run_bench
    from planner.trace import WORKLOADS, generate, load_trace, respace
    from rounds.elastic import RolePlan

    try:
        plan = TypeAdapter(RolePlan).validate_json(role_plan) if role_plan else None
        if trace is not None:
            sessions_list = load_trace(trace)
            label = str(trace) if rate is None else f"{trace} re-spaced to {rate:g}/s (seed {seed})"
            if rate is not None:
                sessions_list = respace(sessions_list, rate, seed)
        elif workload not in WORKLOADS:
            raise ValueError(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")
        else:
            rate = 0.5 if rate is None else rate
            sessions_list = generate(WORKLOADS[workload], sessions, rate, seed)
            label = f"{workload}, {sessions} sessions at {rate:g}/s (seed {seed})"
    except (OSError, ValueError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    setup = LiveSetup(profile, speed, policy, prefill_replicas, decode_replicas, port, redis_url, itl_slo_metric,
                      pool, plan)  # fmt: skip
    raise typer.Exit(run_bench(console, sessions_list, label, setup, out))


@bench_app.command("fidelity")
def bench_fidelity(
    engine: Annotated[str, typer.Option(help="the real engine the simulator is checked against: vllm")] = "vllm",
    sessions: Annotated[int, typer.Option(help="sessions per run")] = 24,
    light_rate: Annotated[float, typer.Option(help="sessions per second at the light load")] = 0.05,
    loaded_rate: Annotated[float, typer.Option(help="sessions per second at the loaded rate")] = 0.2,
    runs: Annotated[int, typer.Option(help="runs of each policy at each load (each its own trace seed)")] = 3,
    policies: Annotated[
        str, typer.Option(help="comma-separated: coloc, ampd, disagg, dynaserve")
    ] = "coloc,ampd,disagg",
    loads: Annotated[str, typer.Option(help="comma-separated: light, loaded")] = "light,loaded",
    workload: Annotated[str, typer.Option(help="trace shape: toolbench, gaia, hotpotqa or dureader")] = "toolbench",
    seed: int = 0,
    profile: Annotated[
        Path | None, typer.Option(help="the engines' measured profile (else `ampd profile --worker` measures it first)")
    ] = None,
    python: Annotated[str, typer.Option(envvar="AMPD_VLLM_PYTHON", help="the interpreter vLLM is installed in")] = "",
    vllm_options: Annotated[
        str, typer.Option(help="more options for vLLM, appended, one string (-O0: starts without torch.compile)")
    ] = "",
    redis_url: Annotated[str, typer.Option(envvar="REDIS_URL")] = "redis://127.0.0.1:6379/11",
    work_dir: Annotated[Path, typer.Option(help="the model folder, profile, logs and runs' traces")] = Path(
        ".ampd/fidelity"
    ),
    resimulate: Annotated[
        Path | None, typer.Option(help="simulate a report's live runs again (after a change to the simulator)")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="write the rows as JSON here")] = None,
) -> None:
    """The simulator against real vLLM engines (its CPU build, two engines on two cores): a
    multi-round trace live through the gateway per policy and load, next to the same rounds simulated."""
    from bench.fidelity import LOADS, POLICIES, FidelitySetup, run_fidelity
    from bench.fidelity import resimulate as simulate_again
    from planner.trace import WORKLOADS

    if resimulate is not None:
        raise typer.Exit(simulate_again(console, resimulate, out))
    chosen, levels = tuple(p for p in policies.split(",") if p), tuple(x for x in loads.split(",") if x)
    if engine != "vllm":
        raise fail("the fidelity bench checks the simulator against vLLM (--engine vllm); the GPU-free engine's "
                   "is `ampd bench run`")  # fmt: skip
    if not chosen or set(chosen) - set(POLICIES) or not levels or set(levels) - set(LOADS):
        raise fail(f"policies: some of {', '.join(POLICIES)}; loads: some of {', '.join(LOADS)}")
    if workload not in WORKLOADS or sessions < 1 or runs < 1 or min(light_rate, loaded_rate) <= 0:
        raise fail(f"a workload of {', '.join(WORKLOADS)}, at least one session and run, and positive rates")
    setup = FidelitySetup(sessions=sessions, light_rate=light_rate, loaded_rate=loaded_rate, runs=runs,
                          workload=workload, seed=seed, policies=chosen, loads=levels, profile=profile,
                          out_dir=work_dir, redis_url=redis_url, vllm_python=python,
                          vllm_options=tuple(shlex.split(vllm_options)))  # fmt: skip
    raise typer.Exit(run_fidelity(console, setup, out))


@bench_app.command("stepsize")
def bench_stepsize(
    engine: Annotated[str, typer.Option(help="the engine whose scheduler is sized: vllm")] = "vllm",
    streams: Annotated[int, typer.Option(help="requests decoding throughout")] = 8,
    long_prompts: Annotated[int, typer.Option(help="long prompts sent while they decode")] = 4,
    long_tokens: Annotated[int, typer.Option(help="tokens of each long prompt")] = 2400,
    interval: Annotated[float, typer.Option(help="seconds between the long prompts")] = 3.0,
    target_ms: Annotated[
        float | None, typer.Option(help="ampd's step target (default: dynaserve's under the P95 rule)")
    ] = None,
    statics: Annotated[
        str | None,
        typer.Option(
            help="the fixed budgets searched, comma-separated, each TOKENS[:CAP[:adaptive]] (default: "
            "2048:256,2048:512,2048:256:adaptive,512,1024)"
        ),
    ] = None,
    baselines: Annotated[
        str, typer.Option(help="vLLM's own arms run beside ampd's, comma-separated: default, static (or none)")
    ] = "default,static",
    profile: Annotated[Path, typer.Option(help="the engine's measured profile")] = Path(
        "bench/results/fidelity_vllm/tiny-llama-cpu_measured.json"
    ),
    profile_skew: Annotated[
        float, typer.Option(help="ampd's scheduler starts from the profile's step costs times this (not its target)")
    ] = 1.0,
    python: Annotated[str, typer.Option(envvar="AMPD_VLLM_PYTHON", help="the interpreter vLLM is installed in")] = "",
    vllm_options: Annotated[
        str, typer.Option(help="more options for vLLM, appended, one string (-O0: starts without torch.compile)")
    ] = "",
    redis_url: Annotated[str, typer.Option(envvar="REDIS_URL")] = "redis://127.0.0.1:6379/11",
    work_dir: Annotated[Path, typer.Option(help="the model folder, logs and step logs")] = Path(".ampd/stepsize"),
    out: Annotated[Path | None, typer.Option(help="write the arms as JSON here")] = None,
) -> None:
    """Step sizing inside real vLLM (its CPU build, one engine on a core): token gaps, decode rate and
    long-prompt TTFT under vLLM's default budget, the best static budget searched, and ampd's scheduler."""
    from bench.stepsize import BASELINES, STATICS, StepsizeSetup, parse_statics, run_stepsize

    if engine != "vllm":
        raise fail("step sizing is measured on vLLM (--engine vllm); the GPU-free engine's is `ampd bench split`")
    if (
        min(streams, long_prompts, long_tokens) < 1
        or min(interval, profile_skew) <= 0
        or (target_ms is not None and target_ms <= 0)
    ):
        raise fail("at least one stream, long prompt and token; a positive interval, target and profile skew")
    try:
        budgets = STATICS if statics is None else parse_statics(statics)
    except ValueError as exc:
        raise fail(str(exc)) from exc
    chosen = tuple(b for b in baselines.split(",") if b and b != "none")
    if set(chosen) - set(BASELINES):
        raise fail(f"bad --baselines {baselines!r}: some of {', '.join(BASELINES)}, or none")
    setup = StepsizeSetup(streams=streams, long_prompts=long_prompts, long_tokens=long_tokens, interval_s=interval,
                          target_ms=target_ms, statics=budgets, profile=profile, out_dir=work_dir,
                          redis_url=redis_url, vllm_python=python, baselines=chosen,
                          profile_skew=profile_skew, vllm_options=tuple(shlex.split(vllm_options)))  # fmt: skip
    raise typer.Exit(run_stepsize(console, setup, out))


@bench_app.command("simulate")
def bench_simulate(
    sessions: int = 10_000,
    rate: Annotated[float, typer.Option(help="ToolBench sessions per second")] = 0.5,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Simulator speed: a ToolBench trace through 8 H20 (Llama-3.1-70B, P and D at TP4), on one core."""
    from bench.simulate import run_simulate_bench

    raise typer.Exit(run_simulate_bench(console, sessions, rate, out))


@bench_app.command("sweep")
def bench_sweep(
    workload: Annotated[str, typer.Option(help="toolbench, gaia, hotpotqa or dureader")] = "toolbench",
    rates: Annotated[str, typer.Option(help="arrival rates, sessions/s, comma-separated")] = "1.0,1.5,2.0,2.5,3.0",
    policies: Annotated[str, typer.Option(help="comma-separated")] = "ampd,disagg,coloc,continuum",
    model: ModelOption = "llama-3.1-70b",
    gpu: Annotated[str, typer.Option(help=f"one of {', '.join(GPUS)}")] = "H20",
    prefill: Annotated[str, typer.Option(help="prefill pool TPxDP of the disaggregated policies")] = "4x1",
    decode: Annotated[str, typer.Option(help="decode pool TPxDP of the disaggregated policies")] = "4x1",
    colocated: Annotated[str, typer.Option(help="the one pool TPxDP of coloc and continuum")] = "4x2",
    profile: ProfilesOption = None,
    sessions: Annotated[int, typer.Option(help="sessions per point")] = 400,
    slo_scale: float = DEFAULT_SCALE,
    itl_slo_metric: ItlRuleOption = "mean",
    seed: int = 0,
    out_dir: Annotated[Path, typer.Option(help="where the JSON, Markdown and PNG go")] = Path("bench/results/policies"),
) -> None:
    """SLO attainment against arrival rate per policy, simulated (the shape of the paper's Figure 4)."""
    from rich.progress import BarColumn, MofNCompleteColumn

    from bench.sweep import sweep, write
    from planner.plan import Judging, parse_pool
    from planner.simulator import Pool
    from planner.trace import WORKLOADS

    if workload not in WORKLOADS:
        raise fail(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")
    book = profile_book(model, profile)
    try:
        rate_list = [float(r) for r in rates.split(",") if r]
        pools = [Pool(book.get(gpu, tp), dp) for tp, dp in map(parse_pool, (prefill, decode, colocated))]
        slo = slo_for(book, gpu, slo_scale, None, None)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            points = sweep(WORKLOADS[workload], rate_list, policies.split(","), (pools[0], pools[1]), pools[2],
                           Judging(book, slo, itl_slo_metric), sessions, seed, progress)  # fmt: skip
    except ValueError as exc:
        raise fail(str(exc)) from exc
    title = (f"{workload}, {model} on {gpu}, {sessions} sessions per point, SLO TTFT {ms(slo.ttft_s)} / "
             f"ITL {ms(slo.itl_s)} by each round's {itl_slo_metric} gap (simulated)")  # fmt: skip
    for path in write(points, out_dir, f"sweep_{workload}", title):
        console.print(f"wrote {path}")


@bench_app.command("paper")
def bench_paper(
    workloads: Annotated[
        str,
        typer.Option(help="comma-separated, of toolbench, hotpotqa, dureader, gaia"),
    ] = "toolbench,hotpotqa,dureader,gaia",
    rates: Annotated[
        list[str] | None, typer.Option(help="WORKLOAD=R1,R2,... (sessions/s) to replace a trace's default rates")
    ] = None,
    rules: Annotated[str, typer.Option(help="ITL rules of the grid, comma-separated: mean, p95, max")] = "mean,p95",
    scales: Annotated[str, typer.Option(help="SLO scales of the grid, comma-separated")] = "3,5",
    model: ModelOption = "llama-3.1-70b",
    gpu: Annotated[str, typer.Option(help=f"one of {', '.join(GPUS)}")] = "H20",
    profile: ProfilesOption = None,
    sessions: Annotated[
        int | None, typer.Option(help="sessions per point; default 300, and 800 for GAIA's minutes-long sessions")
    ] = None,
    sensitivity_rate: Annotated[float, typer.Option(help="DuReader sessions/s for Figure 6; 0 skips it")] = 1.2,
    chunk_ablation: Annotated[
        bool, typer.Option(help="also chunked prefill on the decode workers, at ToolBench's and HotpotQA's knees")
    ] = True,
    seed: int = 0,
    efficiency: Annotated[
        str, typer.Option(help="the roofline's constants: shipped, or calibrated (`ampd profile calibrate`)")
    ] = "shipped",
    compute_efficiency: Annotated[
        float | None, typer.Option(help="the GEMM efficiency the profiles are derived at (a sensitivity sweep)")
    ] = None,
    out_dir: Annotated[Path, typer.Option(help="where the JSON, Markdown and PNGs go")] = Path("bench/results/paper"),
) -> None:
    """The paper's comparison as a grid of ITL rules x SLO scales: every policy on its best deployment (simulated)."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn

    from bench import paper
    from bench.paper import DEFAULT_RATES, DEFAULT_SESSIONS, PAPER_GPUS, Cell, run_trace, sensitivity, trace_slo
    from bench.paper import write as write_paper
    from perfmodel.slo import ITL_RULES
    from planner.plan import Judging

    names = [w for w in workloads.split(",") if w]
    unknown = [w for w in names if w not in PAPER_GPUS]
    if unknown or not names:
        raise fail(f"unknown workloads {unknown}; one or more of {', '.join(PAPER_GPUS)}")
    grid = dict(DEFAULT_RATES)
    started = time.perf_counter()
    try:
        for spec in rates or []:
            name, _, values = spec.partition("=")
            if name not in PAPER_GPUS or not values:
                raise ValueError(f"bad --rates {spec!r}: write WORKLOAD=R1,R2 with a known workload")
            grid[name] = tuple(float(r) for r in values.split(","))
        rule_list = [r for r in rules.split(",") if r]
        if not rule_list or any(r not in ITL_RULES for r in rule_list):
            raise ValueError(f"bad --rules {rules!r}: one or more of {', '.join(ITL_RULES)}")
        cells = [Cell(r, float(x)) for r in rule_list for x in scales.split(",") if x]  # type: ignore[arg-type]
        book = profile_book(model, profile, efficiency, compute_efficiency)
        counts = {w: sessions or DEFAULT_SESSIONS[w] for w in PAPER_GPUS}
        slos = {(w, c.scale): trace_slo(book, gpu, w, c.scale) for w in names for c in cells}
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            points = [p for w in names for p in run_trace(book, gpu, w, grid[w], counts[w], cells, seed, progress)]
        chunked = []
        if chunk_ablation:
            for w in (w for w in names if w in paper.KNEES):
                with console.status(f"chunked prefill at {w}'s knee"):
                    chunked += paper.chunk_ablation(book, gpu, w, paper.KNEES[w], counts[w], cells, seed)
        setup, sensitive = "", []
        if sensitivity_rate > 0:
            dureader = trace_slo(book, gpu, "dureader", 5.0)
            with console.status("sensitivity to w, alpha and beta (DuReader)"):
                setup, sensitive = sensitivity(
                    Judging(book, dureader), gpu, "dureader", sensitivity_rate, counts["dureader"], seed
                )
            setup = f"DuReader, {PAPER_GPUS['dureader']} GPUs, {sensitivity_rate:g} sessions/s, {setup}"
    except ValueError as exc:
        raise fail(str(exc)) from exc
    wall = time.perf_counter() - started
    per_point = ", ".join(f"{w} {counts[w]}" for w in names)
    title = (f"{model} on {gpu}, sessions per point: {per_point} (simulated; every policy on its best "
             f"deployment; {wall / 60:.0f} min on {os.cpu_count()} cores)")  # fmt: skip
    for path in write_paper(out_dir, title, points, cells, slos, chunked, setup, sensitive, wall):
        console.print(f"wrote {path}")


@bench_app.command("sensitivity")
def bench_sensitivity(
    points: Annotated[
        str, typer.Option(help="WORKLOAD=RATE,... (sessions/s): the knees, or the paper's operating point")
    ] = "toolbench=2.5,hotpotqa=1.2",
    efficiencies: Annotated[str, typer.Option(help="GEMM efficiencies the profiles are derived at")] = (
        "0.45,0.55,0.65,0.75,0.85"
    ),
    base: Annotated[str, typer.Option(help="the other constants: shipped or calibrated")] = "shipped",
    rules: Annotated[str, typer.Option(help="ITL rules, comma-separated")] = "mean,p95",
    scales: Annotated[str, typer.Option(help="SLO scales, comma-separated")] = "3,5",
    model: ModelOption = "llama-3.1-70b",
    gpu: Annotated[str, typer.Option(help=f"one of {', '.join(GPUS)}")] = "H20",
    sessions: Annotated[int, typer.Option(help="sessions per point")] = 300,
    seed: int = 0,
    out_dir: Annotated[Path, typer.Option(help="where the JSON and Markdown go")] = Path("bench/results/sensitivity"),
) -> None:
    """The paper grid's winners at each point as the roofline's GEMM efficiency varies (simulated)."""
    from bench import sensitivity
    from bench.paper import PAPER_GPUS, Cell
    from perfmodel.roofline import CALIBRATED_EFFICIENCY, HOPPER_EFFICIENCY
    from perfmodel.slo import ITL_RULES

    try:
        where = []
        for spec in points.split(","):
            name, _, rate = spec.partition("=")
            if name not in PAPER_GPUS or not rate:
                raise ValueError(f"bad point {spec!r}: WORKLOAD=RATE with a workload of {', '.join(PAPER_GPUS)}")
            where.append((name, float(rate)))
        sweep = [float(x) for x in efficiencies.split(",") if x]
        if not sweep or any(not 0 < x <= 1 for x in sweep):
            raise ValueError("efficiencies are fractions of peak in (0, 1]")
        if base not in ("shipped", "calibrated") or any(r not in ITL_RULES for r in rules.split(",")):
            raise ValueError(f"--base is shipped or calibrated; rules are of {', '.join(ITL_RULES)}")
        cells = [Cell(r, float(x)) for r in rules.split(",") for x in scales.split(",")]  # type: ignore[arg-type]
    except ValueError as exc:
        raise fail(str(exc)) from exc
    start = CALIBRATED_EFFICIENCY if base == "calibrated" else HOPPER_EFFICIENCY
    columns = (TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        verdicts = sensitivity.sweep(model, gpu, start, sweep, where, cells, sessions, seed, progress)
    title = f"{model} on {gpu}: each cell's winners as the GEMM efficiency varies ({base} constants otherwise)"
    for path in sensitivity.write(out_dir, title, verdicts):
        console.print(f"wrote {path}")


@bench_app.command("split")
def bench_split(
    workloads: Annotated[
        str, typer.Option(help="traces, comma-separated, each at its knee")
    ] = "toolbench,hotpotqa,dureader",
    rules: Annotated[str, typer.Option(help="ITL rules, comma-separated: mean, p95, max")] = "mean,p95",
    scales: Annotated[str, typer.Option(help="SLO scales, comma-separated")] = "3,5",
    model: ModelOption = "llama-3.1-70b",
    gpu: Annotated[str, typer.Option(help=f"one of {', '.join(GPUS)}")] = "H20",
    profile: ProfilesOption = None,
    sessions: int = 300,
    seed: int = 0,
    out_dir: Annotated[Path, typer.Option(help="where the JSON and Markdown go")] = Path("bench/results/split"),
) -> None:
    """DynaServe's split and its SLO-aware batching apart, on every pool of two or more engines (simulated)."""
    import time

    from bench import split
    from bench.paper import KNEES, Cell
    from perfmodel.slo import ITL_RULES

    names = [w for w in workloads.split(",") if w]
    rule_list = [r for r in rules.split(",") if r]
    if not names or any(w not in KNEES for w in names):
        raise fail(f"bad --workloads {workloads!r}: one or more of {', '.join(KNEES)}")
    if not rule_list or any(r not in ITL_RULES for r in rule_list):
        raise fail(f"bad --rules {rules!r}: one or more of {', '.join(ITL_RULES)}")
    cells = [Cell(r, float(x)) for r in rule_list for x in scales.split(",") if x]  # type: ignore[arg-type]
    book, started, points = profile_book(model, profile), time.perf_counter(), []
    for w in names:
        with console.status(f"{w} at {KNEES[w]:g} sessions/s"):
            points += split.run_split(book, gpu, w, KNEES[w], sessions, cells, seed)
    title = (f"{model} on {gpu}, {sessions} sessions per point at each trace's knee (simulated; "
             f"{(time.perf_counter() - started) / 60:.0f} min on {os.cpu_count()} cores)")  # fmt: skip
    console.print(split.markdown(points, title))
    for path in split.write(out_dir, points, title):
        console.print(f"wrote {path}")


@bench_app.command("placement")
def bench_placement(
    rates: Annotated[str, typer.Option(help="rates to find the knee among, ascending (sessions/s); one: run there")] = (
        "0.3,0.4,0.5,0.6,0.8"
    ),
    rules: Annotated[str, typer.Option(help="ITL rules, comma-separated: mean, p95, max")] = "mean,p95",
    profile: Annotated[str, typer.Option(help="the engines' profile (one TP degree for both pools)")] = (
        "llama-3.1-70b_h20_tp4"
    ),
    prefill: Annotated[int, typer.Option(min=1, help="prefill engines")] = 4,
    decode: Annotated[int, typer.Option(min=1, help="decode engines")] = 4,
    workload: str = "toolbench",
    agents: AgentsOption = 16,
    tenants: TenantsOption = 8,
    sessions: int = 1000,
    policy: PolicyOption = "ampd",
    scale: Annotated[float, typer.Option(help="SLO scale over the unloaded typical round")] = DEFAULT_SCALE,
    seeds: Annotated[
        str, typer.Option(help="trace seeds, comma-separated: each runs every row; the knee is the first's")
    ] = ("0,1,2"),
    out: Annotated[Path, typer.Option(help="JSON of the rows (a Markdown table goes beside it)")] = Path(
        "bench/results/placement/placement.json"
    ),
) -> None:
    """Every placement rule (rounds.placement) x ITL rule x trace seed, on a shared-prefix agent trace at its knee
    (simulated)."""
    import time

    from bench import placement
    from perfmodel.profile import load_profile
    from perfmodel.slo import ITL_RULES
    from planner.trace import WORKLOADS, Agents

    rule_list = [r for r in rules.split(",") if r]
    if not rule_list or any(r not in ITL_RULES for r in rule_list):
        raise fail(f"bad --rules {rules!r}: one or more of {', '.join(ITL_RULES)}")
    if workload not in WORKLOADS:
        raise fail(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")
    rate_list = sorted(float(r) for r in rates.split(",") if r)
    try:
        seed_list = [int(s) for s in seeds.split(",") if s]
    except ValueError:
        seed_list = []
    if not seed_list:
        raise fail(f"bad --seeds {seeds!r}: comma-separated integers")
    setup = placement.Setup(load_profile(profile), prefill, decode, workload, Agents(agents, tenants), sessions,
                            seed_list[0], policy, scale)  # fmt: skip
    started = time.perf_counter()
    with console.status("finding memory's knee"):
        rate = placement.knee(setup, rate_list) if len(rate_list) > 1 else rate_list[0]
    with console.status(f"{len(rule_list) * len(seed_list) * 5} simulations at {rate:g} sessions/s"):
        rows = placement.run_placement(setup, rate, rule_list, seed_list)  # type: ignore[arg-type]
    title = (f"Placement on {profile}, {prefill} prefill + {decode} decode engines ({setup.gpus} GPUs), {workload} "
             f"with {agents} agent types x {tenants} tenants, {sessions} sessions at {rate:g}/s, seeds {seeds}, "
             f"policy {policy} "
             f"(simulated; {(time.perf_counter() - started) / 60:.0f} min on {os.cpu_count()} cores)")  # fmt: skip
    console.print(title)
    console.print(placement.table(rows))
    for path in placement.write(out, rows, setup, rate, title):
        console.print(f"wrote {path}")


@bench_app.command("peers")
def bench_peers(
    arms: Annotated[
        str,
        typer.Option(
            help="comma-separated; colocated: ampd-<placement> (memory, ampd, dynamo-kv, llmd-prefix, "
            "sglang-cache), vllm-router, sglang-router, smg, dynamo; prefill/decode: ampd-pd, ampd-tail, "
            "ampd-disagg, vllm-router-pd [default: the deployment's]"
        ),
    ] = "",
    deployment: Annotated[str, typer.Option(help="coloc: every engine prefills and decodes; pd: prefill/decode")] = (
        "coloc"
    ),
    prefill_engines: Annotated[int, typer.Option(min=1, help="under --deployment pd: engines that prefill")] = 1,
    sessions: Annotated[int, typer.Option(min=1, help="agent sessions in the trace")] = 60,
    rate: Annotated[float, typer.Option(help="sessions per modelled second (Poisson)")] = 0.25,
    agents: AgentsOption = 12,
    tenants: TenantsOption = 2,
    workload: str = "toolbench",
    engines: Annotated[int, typer.Option(min=1, help="GPU-free engines, all on one core")] = 3,
    num_blocks: Annotated[int, typer.Option(min=1, help="KV blocks per engine")] = 10_625,
    block_size: int = 16,
    max_model_len: int = 40_960,
    profile: Annotated[str, typer.Option(help="the engines' profile")] = "llama-3.1-70b_h20_tp4",
    speed: Annotated[float, typer.Option(help="the engines run this many times faster than the profile")] = 5.0,
    scale: Annotated[float, typer.Option(help="SLO scale over the unloaded mean round")] = DEFAULT_SCALE,
    rules: Annotated[str, typer.Option(help="ITL rules, comma-separated: mean, p95, max")] = "mean,p95",
    policy: Annotated[str, typer.Option(help="the ampd gateway's policy")] = "coloc",
    prefill_slots: Annotated[int, typer.Option(min=1, help="the ampd gateway's --prefill-slots")] = 1,
    seed: int = 0,
    out: Annotated[Path | None, typer.Option(help="JSON of the rows (a Markdown table goes beside it)")] = Path(
        "bench/results/peers/peers.json"
    ),
) -> None:
    """ampd against vllm-router, SGLang's gateway and Dynamo, live on the same GPU-free engines and agent trace."""
    from bench.peers import DEFAULT_ARMS, PeersSetup, run_peers_bench
    from perfmodel.slo import ITL_RULES
    from planner.trace import WORKLOADS

    rule_list = tuple(r for r in rules.split(",") if r)
    if not rule_list or any(r not in ITL_RULES for r in rule_list):
        raise fail(f"bad --rules {rules!r}: one or more of {', '.join(ITL_RULES)}")
    if workload not in WORKLOADS:
        raise fail(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")
    if deployment not in DEFAULT_ARMS:
        raise fail(f"unknown deployment {deployment!r}; one of {', '.join(DEFAULT_ARMS)}")
    setup = PeersSetup(engines, sessions, rate, workload, agents, tenants, seed, profile, speed, num_blocks,
                       block_size, max_model_len, scale, policy, prefill_slots, rule_list, deployment,  # type: ignore[arg-type]
                       prefill_engines)  # fmt: skip
    console.width = max(console.width, 130)
    chosen = [a for a in (arms or DEFAULT_ARMS[deployment]).split(",") if a]
    raise typer.Exit(run_peers_bench(console, setup, chosen, out))


@bench_app.command("elastic")
def bench_elastic(
    traces: Annotated[
        list[str] | None,
        typer.Option(help="NAME=WORKLOAD:SHAPE:LOW:HIGH:SECONDS[:TO_WORKLOAD] (repeat); default: four shapes"),
    ] = None,
    rules: Annotated[str, typer.Option(help="ITL rules, comma-separated: mean, p95, max")] = "mean,p95,max",
    model: ModelOption = "llama-3.1-70b",
    gpu: Annotated[str, typer.Option(help=f"one of {', '.join(GPUS)}")] = "H20",
    gpus: Annotated[int, typer.Option(help="the cluster every deployment fills")] = 8,
    slo_scale: Annotated[float, typer.Option(help="SLO: this x the unloaded latency of a trace's round")] = 5.0,
    seed: int = 0,
    out_dir: Annotated[Path, typer.Option(help="where the JSON, Markdown and PNGs go")] = Path("bench/results/elastic"),
) -> None:
    """Time-varying load: elastic roles against every policy's best fixed deployment (simulated)."""
    import time

    from bench.elastic import DEFAULT_TRACES, ShapedTrace, run_shaped
    from bench.elastic import write as write_elastic
    from bench.paper import trace_slo
    from perfmodel.slo import ITL_RULES
    from planner.plan import Judging
    from planner.trace import SHAPES, WORKLOADS, Shape

    try:
        chosen = list(DEFAULT_TRACES)
        if traces:
            chosen = []
            for spec in traces:
                name, _, rest = spec.partition("=")
                workload, kind, low, high, seconds, *to = rest.split(":")
                if not name or workload not in WORKLOADS or kind not in SHAPES or (to and to[0] not in WORKLOADS):
                    raise ValueError(f"bad --traces {spec!r}: NAME=WORKLOAD:SHAPE:LOW:HIGH:SECONDS[:TO_WORKLOAD]")
                shape = Shape(kind, float(seconds), float(low), float(high))  # type: ignore[arg-type]
                chosen.append(ShapedTrace(name, workload, shape, to[0] if to else None))
        rule_list = [r for r in rules.split(",") if r]
        if not rule_list or any(r not in ITL_RULES for r in rule_list):
            raise ValueError(f"bad --rules {rules!r}: one or more of {', '.join(ITL_RULES)}")
        book = profile_book(model, None)
        started = time.perf_counter()
        outcomes, verdicts, timelines = [], [], {}
        for trace in chosen:
            slo = trace_slo(book, gpu, trace.workload, slo_scale)
            with console.status(f"{trace.name}: every policy, and elastic on each pool"):
                o, v, t = run_shaped(Judging(book, slo), gpu, gpus, trace, rule_list, seed)  # type: ignore[arg-type]
            outcomes, verdicts, timelines[trace.name] = outcomes + o, verdicts + v, t
            for verdict in v:
                console.print(f"{trace.name}, {verdict.rule}: elastic {verdict.elastic.slo_attainment_rounds:.1%}, "
                              f"best fixed {verdict.best_fixed.slo_attainment_rounds:.1%} "
                              f"({verdict.best_fixed.policy}), goal {verdict.required:.1%}")  # fmt: skip
    except ValueError as exc:
        raise fail(str(exc)) from exc
    wall = time.perf_counter() - started
    title = (f"{model} on {gpus} {gpu}, SLO scale {slo_scale:g} (simulated; {wall / 60:.0f} min on "
             f"{os.cpu_count()} cores)")  # fmt: skip
    for path in write_elastic(out_dir, title, outcomes, verdicts, timelines, wall):
        console.print(f"wrote {path}")


@bench_app.command("plan")
def bench_plan(
    sizes: Annotated[str, typer.Option(help="cluster sizes in H20 GPUs, from 8, 64 and 256")] = "8,64,256",
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """The whole planning path's time for 8, 64 and 256 GPUs (ToolBench traces), beside the paper's minute."""
    from bench.plan import run_plan_bench

    try:
        chosen = [int(n) for n in sizes.split(",") if n]
    except ValueError as exc:
        raise fail(f"bad --sizes {sizes!r}: GPU counts, comma-separated") from exc
    console.width = max(console.width, 130)  # the table's width; a pipe would otherwise get 80 columns
    raise typer.Exit(run_plan_bench(console, chosen, out))


@bench_app.command("ilp")
def bench_ilp(
    repeats: Annotated[int, typer.Option(help="runs per cluster size; the median is reported")] = 5,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Eq. 5's solve time in SCIP for 8 to 256 GPUs, next to the brute force (synthetic taus)."""
    from bench.ilp import run_ilp_bench

    console.width = max(console.width, 110)  # the table's width; a pipe would otherwise get 80 columns
    raise typer.Exit(run_ilp_bench(console, repeats, out))


@bench_app.command("signals")
def bench_signals(
    levels: Annotated[str, typer.Option(help="prefill workers in the pool, comma-separated")] = "2,16,64,256",
    rounds: Annotated[int, typer.Option(help="rounds measured at each level")] = 3_000,
    rate: Annotated[float, typer.Option(help="rounds per (virtual) second")] = 150.0,
    window_s: Annotated[int, typer.Option(help="the statistics' window")] = 10,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Redis's time per round on the windowed TTFT/ITL statistics, by the pool's size."""
    from bench.signals import run_signals_bench

    level_list = [int(x) for x in levels.split(",")]
    raise typer.Exit(run_signals_bench(console, level_list, rounds, rate, window_s, out))


@bench_app.command("kv-index")
def bench_kv_index(
    batches: Annotated[int, typer.Option(help="event batches (engine steps) ingested")] = 20_000,
    blocks_per_store: Annotated[int, typer.Option(help="blocks each step stores")] = 8,
    capacity_blocks: Annotated[int, typer.Option(help="the engine's KV capacity in blocks (kept full)")] = 100_000,
    prompt_tokens: Annotated[int, typer.Option(help="the looked-up prompt's tokens")] = 32_768,
    engines: Annotated[int, typer.Option(help="engines the prompt is matched on")] = 8,
    repeats: Annotated[int, typer.Option(help="lookups timed")] = 50,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """The gateway's KV index: events ingested per second per core, a long prompt's lookup, bytes per block."""
    from bench.kv_index import run_kv_index_bench

    code = run_kv_index_bench(console, batches, blocks_per_store, capacity_blocks, prompt_tokens, engines, repeats, out)
    raise typer.Exit(code)
