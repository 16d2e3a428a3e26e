"""`ampd trace`, `ampd simulate` and `ampd plan`: the offline side of the command line."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ampd import terminal
from perfmodel.catalog import GPUS, MODELS
from perfmodel.slo import DEFAULT_SCALE, ITL_RULES, SLO, ItlRule
from rounds.policies import POLICIES

ModelOption = Annotated[str, typer.Option(help=f"one of {', '.join(MODELS)}")]
ProfilesOption = Annotated[list[Path] | None, typer.Option(help="measured profile files instead of derived ones")]
ItlRuleOption = Annotated[
    ItlRule,
    typer.Option(
        "--itl-slo-metric", help="a round meets its ITL SLO by its mean gap (TPOT), its P95 gap, or its longest gap"
    ),
]
PolicyOption = Annotated[str, typer.Option(help="one of: " + ", ".join(POLICIES))]
trace_app = typer.Typer(help="Multi-round workload traces (JSONL).", no_args_is_help=True)
console = terminal.console()


def fail(message: str) -> typer.Exit:
    console.print(f"[red]{message}[/red]")
    return typer.Exit(2)


@trace_app.command("generate")
def trace_generate(
    out: Annotated[Path, typer.Option(help="JSONL file to write")],
    workload: Annotated[str, typer.Option(help="toolbench, gaia, hotpotqa or dureader")] = "toolbench",
    sessions: Annotated[int, typer.Option(min=1, help="sessions at a constant rate")] = 1000,
    rate: Annotated[float, typer.Option(help="sessions per second (Poisson); a shape's lowest rate")] = 1.0,
    shape: Annotated[
        str | None,
        typer.Option(help="load that varies in time: ramp, burst, diurnal, or mix (one workload to another)"),
    ] = None,
    peak_rate: Annotated[float | None, typer.Option(help="a shape's highest rate (sessions/s)")] = None,
    duration: Annotated[float, typer.Option(help="a shape's length in seconds")] = 600.0,
    to_workload: Annotated[str, typer.Option(help="the workload a mix shifts to")] = "gaia",
    agents: Annotated[
        int, typer.Option(min=0, help="agent types whose system prompt and tool schemas sessions share (0: none)")
    ] = 0,
    tenants: Annotated[int, typer.Option(min=1, help="tenants, each with its own tool schemas (with --agents)")] = 1,
    seed: int = 0,
) -> None:
    """A trace shaped like one of the paper's four workloads (Table 1 means), at a constant rate or one that varies;
    with --agents, its sessions drawn from agent types that share their prompts' prefix (docs/usage.md)."""
    from planner.trace import (
        SHAPES,
        WORKLOADS,
        Agents,
        Shape,
        generate,
        generate_shaped,
        summarize,
        with_agents,
        write_trace,
    )

    if workload not in WORKLOADS or to_workload not in WORKLOADS:
        raise fail(f"unknown workload {workload!r} or {to_workload!r}; one of {', '.join(WORKLOADS)}")
    if shape is not None and shape not in SHAPES:
        raise fail(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
    try:
        if shape is None:
            trace = generate(WORKLOADS[workload], sessions, rate, seed)
        else:
            varying = Shape(shape, duration, rate, peak_rate or rate)  # type: ignore[arg-type]
            trace = generate_shaped(WORKLOADS[workload], varying, seed, WORKLOADS[to_workload])
        if agents:
            trace = with_agents(trace, Agents(agents, tenants), seed)
    except ValueError as exc:
        raise fail(str(exc)) from exc
    write_trace(trace, out)
    summary, target = summarize(trace), WORKLOADS[workload]
    table = Table("", "this trace", "paper (Table 1)" if shape != "mix" else f"paper ({workload}, then {to_workload})")
    table.add_row("sessions", str(summary["sessions"]), "")
    table.add_row("rounds / session", f"{summary['mean_rounds']:.2f}", f"{target.mean_rounds}")
    table.add_row("prompt tokens / call", f"{summary['mean_prompt_tokens']:.1f}", f"{target.mean_prompt_tokens}")
    table.add_row("prompt tokens added / round", f"{summary['mean_added_tokens']:.1f}", "")
    table.add_row("output tokens / round", f"{summary['mean_output_tokens']:.1f}", f"{target.mean_output_tokens}")
    table.add_row("arrival rate (/s)", f"{summary['arrival_rate']:.3f}", f"{rate}" if shape is None else
                  f"{rate} to {peak_rate or rate} ({shape})")  # fmt: skip
    console.print(table)
    console.print(f"wrote {out}")


def _load(trace: Path):
    from planner.trace import load_trace

    try:
        return load_trace(trace)
    except (OSError, ValueError) as exc:
        raise fail(str(exc)) from exc


def profile_book(model: str, profiles: list[Path] | None, efficiency: str = "shipped", compute: float | None = None):
    """The profiles a command runs on: ``profiles`` given, the rest shipped or, with
    ``efficiency`` ``calibrated`` or a ``compute`` efficiency, derived by the roofline."""
    from perfmodel.profile import load_profile
    from perfmodel.roofline import CALIBRATED_EFFICIENCY, HOPPER_EFFICIENCY
    from planner.plan import ProfileBook

    if efficiency not in ("shipped", "calibrated"):
        raise fail("--efficiency is shipped or calibrated")
    chosen = CALIBRATED_EFFICIENCY if efficiency == "calibrated" else None
    if compute is not None:
        if not 0 < compute <= 1:
            raise fail("--compute-efficiency is a fraction of peak, in (0, 1]")
        base = chosen or HOPPER_EFFICIENCY
        chosen = base.model_copy(update={"compute": compute, "source": f"{base.source}; compute set to {compute:g}"})
    try:
        return ProfileBook(model, [load_profile(p) for p in profiles or []], chosen)
    except (OSError, ValueError) as exc:
        raise fail(str(exc)) from exc


def slo_for(book, gpu: str, scale: float, ttft: float | None, itl: float | None) -> SLO:
    derived = book.reference_slo(gpu, scale)
    return SLO(ttft or derived.ttft_s, itl or derived.itl_s)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.0f} ms"


def _roles(report) -> str:
    """Prefill engines at a few times of an elastic run: "0 s: 0, 300 s: 2, ..."."""
    shown = report.roles[:: max(1, len(report.roles) // 6)]
    return ", ".join(f"{r.at:,.0f} s: {r.prefill}" for r in shown)


def report_table(reports) -> Table:
    """Simulation reports side by side, one column each."""
    table = Table("", *[f"P {r.prefill}\nD {r.decode}\n{r.policy}" for r in reports])
    rows = [
        ("TTFT initial mean / P95", lambda r: f"{ms(r.ttft_initial.mean_s)} / {ms(r.ttft_initial.p95_s)}"),
        (
            "TTFT incremental mean / P95",
            lambda r: f"{ms(r.ttft_incremental.mean_s)} / {ms(r.ttft_incremental.p95_s)}",
        ),
        ("ITL per round: mean gap, mean / P95", lambda r: f"{ms(r.itl.mean_s)} / {ms(r.itl.p95_s)}"),
        ("ITL per round: P95 gap, mean / P95", lambda r: f"{ms(r.itl_p95.mean_s)} / {ms(r.itl_p95.p95_s)}"),
        ("ITL per round: longest gap, mean / P95", lambda r: f"{ms(r.itl_max.mean_s)} / {ms(r.itl_max.p95_s)}"),
        ("SLO attainment, rounds", lambda r: f"{r.slo_attainment_rounds:.1%} (ITL by {r.itl_rule})"),
        (
            "  by mean / P95 / longest gap",
            lambda r: " / ".join(f"{r.slo_attainment_by_rule[rule]:.1%}" for rule in ITL_RULES),
        ),
        ("SLO attainment, sessions", lambda r: f"{r.slo_attainment_sessions:.1%}"),
        ("incremental prefills local", lambda r: f"{r.local_share_incremental:.1%}"),
        ("rounds split between two engines", lambda r: f"{r.split_share:.1%}"),
        ("utilisation", lambda r: ", ".join(f"{w.worker_id} {w.utilisation:.0%}" for w in r.workers)),
        ("role moves; prefill engines over time", lambda r: f"{r.moves}; " + _roles(r) if r.roles else "-"),
        ("sessions / rounds", lambda r: f"{r.sessions:,} / {r.rounds:,}"),
        ("simulated / wall", lambda r: f"{r.makespan_s:,.0f} s / {r.wall_s:.1f} s"),
    ]
    for label, cell in rows:
        table.add_row(label, *[cell(r) for r in reports])
    return table


def simulate_command(
    trace: Annotated[Path, typer.Option(help="JSONL trace (`ampd trace generate`)")],
    model: ModelOption = "llama-3.1-70b",
    gpu: Annotated[str, typer.Option(help=f"one of {', '.join(GPUS)}")] = "H20",
    prefill: Annotated[str | None, typer.Option(help="prefill pool TPxDP, e.g. 4x1; none for colocated")] = "4x1",
    decode: Annotated[str, typer.Option(help="decode pool TPxDP")] = "4x1",
    pool: Annotated[
        str | None, typer.Option(help="TPxN engines of an elastic policy (roles follow the load) or dynaserve")
    ] = None,
    initial_prefill: Annotated[
        int | None, typer.Option(help="engines of --pool that start as prefill; default: the role plan's, else 0")
    ] = None,
    role_plan: Annotated[
        str | None, typer.Option(envvar="AMPD_ROLE_PLAN", help="--pool's split by load, JSON (`ampd plan`)")
    ] = None,
    policy: PolicyOption = "ampd",
    profile: ProfilesOption = None,
    slo_scale: float = DEFAULT_SCALE,
    ttft_slo_s: float | None = None,
    itl_slo_s: float | None = None,
    itl_slo_metric: ItlRuleOption = "mean",
    decode_prefill_chunk: Annotated[
        int, typer.Option(help="decode workers prefill at most this many tokens of a request a step; 0: no cap")
    ] = 0,
    seed: int = 0,
    out: Annotated[Path | None, typer.Option(help="write the report as JSON here")] = None,
) -> None:
    """Discrete-event simulation of a deployment on the gateway's and the engine's own cores."""
    from pydantic import TypeAdapter

    from planner.plan import parse_pool
    from planner.role_plan import opening_load
    from planner.simulator import Pool, SimConfig, simulate
    from rounds.elastic import RolePlan

    if policy not in POLICIES:
        raise fail(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
    if gpu not in GPUS:
        raise fail(f"unknown GPU type {gpu!r}; one of {', '.join(GPUS)}")
    elastic = POLICIES[policy].elastic is not None
    if POLICIES[policy].on_pool != (pool is not None):
        raise fail("elastic policies and dynaserve run on --pool TPxN (and only they do)")
    sessions, book = _load(trace), profile_book(model, profile)
    try:
        pools = {}
        specs = (("decode", pool),) if pool is not None else (("prefill", prefill), ("decode", decode))
        for phase, spec in specs:
            if spec and spec.lower() != "none":
                tp, dp = parse_pool(spec)
                pools[phase] = Pool(book.get(gpu, tp), dp)
        plan = TypeAdapter(RolePlan).validate_json(role_plan) if role_plan else None
        if plan is not None and not elastic:
            raise ValueError(f"a role plan steers an elastic policy, not {policy!r}")
        if initial_prefill is None:
            initial_prefill = plan.target(opening_load(sessions)) if plan else 0
        if not 0 <= initial_prefill < pools["decode"].replicas:
            raise ValueError("--initial-prefill must leave the pool at least one decode engine")
        slo = slo_for(book, gpu, slo_scale, ttft_slo_s, itl_slo_s)
    except ValueError as exc:  # pydantic's ValidationError too
        raise fail(str(exc)) from exc
    config = SimConfig(
        decode=pools["decode"], prefill=pools.get("prefill"), slo=slo, policy=policy, seed=seed,
        itl_rule=itl_slo_metric, decode_prefill_chunk=decode_prefill_chunk, initial_prefill=initial_prefill,
        role_plan=plan,
    )  # fmt: skip
    with console.status(f"simulating {len(sessions):,} sessions"):
        report = simulate(config, sessions)
    console.print(report_table([report]))
    console.print(f"SLO: TTFT {ms(slo.ttft_s)}, ITL {ms(slo.itl_s)} by each round's {itl_slo_metric} gap")
    if out is not None:
        out.write_text(report.model_dump_json(indent=2) + "\n")
        console.print(f"wrote {out}")


def deployment_label(d) -> str:
    """A split deployment in one line, as the planner's tables show it."""
    return f"P <TP={d.prefill.tp}, DP={d.prefill.replicas}> {d.prefill.gpu}, D <TP={d.decode.tp}, DP={d.decode.replicas}> {d.decode.gpu}"  # noqa: E501


def plan_command(
    trace: Annotated[Path, typer.Option(help="JSONL trace the deployment must serve")],
    gpus: Annotated[str, typer.Option(help="GPUs: a count of --gpu-type, or TYPE=N,TYPE=N")] = "8",
    gpu_type: Annotated[str, typer.Option(help=f"one of {', '.join(GPUS)}")] = "H20",
    model: ModelOption = "llama-3.1-70b",
    policy: PolicyOption = "ampd",
    profile: ProfilesOption = None,
    slo_scale: float = DEFAULT_SCALE,
    ttft_slo_s: float | None = None,
    itl_slo_s: float | None = None,
    itl_slo_metric: ItlRuleOption = "mean",
    top: int = 3,
    candidates: Annotated[int, typer.Option(help="Eq. 5's best N, each simulated whole")] = 5,
    validate: Annotated[bool, typer.Option(help="also simulate every feasible configuration and compare")] = False,
    out: Annotated[Path, typer.Option(help="deployment file to write (and its .env twin)")] = Path("deployment.json"),
    report: Annotated[Path | None, typer.Option(help="write the ranking and taus as JSON here")] = None,
    helm_values: Annotated[
        Path | None, typer.Option(help="also write the deployment as values for the Helm chart (deploy/helm/ampd)")
    ] = None,
) -> None:
    """Pick TP and DP for each phase (simulated taus, then Eq. 5 solved with SCIP); for an
    elastic policy, the pool and its split at each load (simulated)."""
    from perfmodel.profile import shipped_profiles
    from planner import plan as planning

    if policy not in POLICIES:
        raise fail(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
    try:
        capacity = planning.parse_gpus(gpus, gpu_type)
    except ValueError as exc:
        raise fail(str(exc)) from exc
    sessions, book = _load(trace), profile_book(model, profile)
    slo = slo_for(book, next(iter(capacity)), slo_scale, ttft_slo_s, itl_slo_s)
    judging = planning.Judging(book, slo, itl_slo_metric, policy)
    if POLICIES[policy].elastic is not None:
        if len(capacity) != 1:
            raise fail("an elastic pool is one GPU type: pass a count, e.g. --gpus 8 --gpu-type H20")
        ((gpu, count),) = capacity.items()
        _plan_pool(judging, sessions, gpu, count, out, helm_values)
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("planning")

        def progress(text: str) -> None:
            bar.update(task, description=text)

        try:
            jobs = os.cpu_count() or 1
            result = planning.plan(judging, sessions, capacity, top, candidates, progress, jobs)
            checked = []
            if validate:
                checked = planning.exhaustive(judging, sessions, result.options, capacity, progress, jobs)
        except ValueError as exc:
            raise fail(str(exc)) from exc
    table = Table("rank", "configuration", "Eq. 5 rank", "Z", "tau_pre", "tau_dec", "P95 TTFT", "SLO attainment")
    for i, r in enumerate(result.ranked, 1):
        d, eq5 = r.deployment, f"#{r.eq5_rank}" if r.eq5_rank else "split search"
        table.add_row(
            f"#{i}", deployment_label(d), eq5, f"{d.z:.2f}", f"{d.prefill.tau:.2f}", f"{d.decode.tau:.2f}",
            ms(r.predicted.ttft.p95_s), f"{r.predicted.slo_attainment_rounds:.1%}",
        )  # fmt: skip
    console.print(table)
    console.print(
        f"SLO: TTFT {ms(slo.ttft_s)}, ITL {ms(slo.itl_s)}; {len(result.options)} tau coefficients, "
        f"{len(result.samples)} simulated and the rest bounded; SCIP's solves took {result.solve_s:.2f} s"
    )
    if checked:
        side = Table("rank", "planner (Eq. 5)", "simulated whole (by SLO attainment)", "attainment")
        for i in range(max(len(result.ranked), 3)):
            mine = deployment_label(result.ranked[i].deployment) if i < len(result.ranked) else "-"
            theirs = checked[i] if i < len(checked) else None
            side.add_row(f"#{i + 1}", mine, deployment_label(theirs.deployment) if theirs else "-",
                         f"{theirs.predicted.slo_attainment_rounds:.1%}" if theirs else "-")  # fmt: skip
        console.print(side)
        same = result.ranked[0].deployment == checked[0].deployment
        console.print(("[green]" if same else "[yellow]") + f"planner's #1 {'equals' if same else 'differs from'} "
                      f"the best of {len(checked)} simulated configurations")  # fmt: skip
    best = result.ranked[0]
    deployment = planning.deployment_file(judging, best)
    out.parent.mkdir(parents=True, exist_ok=True)
    for phase in ("prefill", "decode"):  # profiles derived on the fly go beside the deployment
        chosen = getattr(deployment, phase)
        if chosen.profile not in shipped_profiles():
            path = out.parent / f"{chosen.profile}.json"
            book.get(chosen.gpu, chosen.tp).dump(path)
            deployment = deployment.model_copy(update={phase: chosen.model_copy(update={"profile": str(path)})})
    env = deployment.write(out)
    console.print(f"wrote {out} and {env}")
    _write_helm_values(deployment, helm_values)
    if report is not None:
        report.write_text(json.dumps(_plan_json(result, checked), indent=2) + "\n")
        console.print(f"wrote {report}")


def _plan_pool(judging, sessions, gpu: str, gpus: int, out: Path, helm: Path | None = None) -> None:
    """`ampd plan --policy elastic`: each pool's role plan, the pools ranked by the elastic
    policy simulated on the trace, and the deployment file of the best."""
    from perfmodel.profile import shipped_profiles
    from planner.plan import DeploymentFile, PhaseDeployment, simulate_all
    from planner.role_plan import rank

    def run(configs, traces):
        return simulate_all(list(zip(configs, traces, strict=True)), os.cpu_count() or 1)

    with console.status("simulating every pool's static splits at the trace's loads, then elastic on each"):
        try:
            ranked = rank(judging, sessions, gpu, gpus, run)
        except ValueError as exc:
            raise fail(str(exc)) from exc
    table = Table("rank", "pool", "split by load (rounds/s: prefill engines)", "moves", "P95 TTFT", "SLO attainment")
    for i, p in enumerate(ranked, 1):
        steps = ", ".join(f"{s.rounds_per_s:g}: {s.best}" for s in p.plan.steps)
        table.add_row(f"#{i}", f"TP={p.tp} x {p.engines} on {gpu}", steps, str(p.predicted.moves),
                      ms(p.predicted.ttft.p95_s), f"{p.predicted.slo_attainment_rounds:.1%}")  # fmt: skip
    console.print(table)
    book, slo, rule, policy = judging.book, judging.slo, judging.itl_rule, judging.policy
    console.print(f"SLO: TTFT {ms(slo.ttft_s)}, ITL {ms(slo.itl_s)} by each round's {rule} gap")
    best = ranked[0]
    profile = book.get(gpu, best.tp)
    name = profile.name
    out.parent.mkdir(parents=True, exist_ok=True)
    if name not in shipped_profiles():  # a profile derived on the fly goes beside the deployment
        name = str(out.parent / f"{profile.name}.json")
        profile.dump(Path(name))
    deployment = DeploymentFile(
        model=book.model.name, policy=policy, pool=PhaseDeployment(gpu=gpu, tp=best.tp, replicas=best.engines,
        profile=name), role_plan=best.plan, ttft_slo_s=slo.ttft_s, itl_slo_s=slo.itl_s, itl_rule=rule,
        predicted_slo_attainment=best.predicted.slo_attainment_rounds, predicted_p95_ttft_s=best.predicted.ttft.p95_s,
    )  # fmt: skip
    env = deployment.write(out)
    console.print(f"wrote {out} and {env}")
    _write_helm_values(deployment, helm)


def _write_helm_values(deployment, path: Path | None) -> None:
    """`ampd plan --helm-values`: the deployment as the Helm chart's values (JSON, which is
    YAML: `helm install -f` reads it), profile files the plan derived embedded in them."""
    if path is None:
        return
    files = [p.profile for p in (deployment.prefill, deployment.decode, deployment.pool) if p is not None]
    texts = {f: Path(f).read_text() for f in files if f.endswith(".json")}
    header = "# ampd plan's deployment as values for deploy/helm/ampd (JSON is YAML): helm install -f this\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + json.dumps(deployment.helm_values(texts), indent=2) + "\n")
    console.print(f"wrote {path}")


def _plan_json(result, checked) -> dict:
    simulated = {(s.phase, s.gpu, s.tp, s.replicas) for s in result.samples}  # the rest are bounds (tau_search)

    def entry(r) -> dict:
        d = r.deployment
        return {"configuration": deployment_label(d), "eq5_rank": r.eq5_rank, "z": d.z, "tau_prefill": d.prefill.tau,
                "tau_decode": d.decode.tau, "predicted": r.predicted.model_dump()}  # fmt: skip

    return {
        "slo": {"ttft_s": result.slo.ttft_s, "itl_s": result.slo.itl_s},
        "planner": [entry(r) for r in result.ranked],
        "exhaustive": [entry(r) for r in checked],
        "taus": [asdict(o) | {"simulated": (o.phase, o.gpu, o.tp, o.replicas) in simulated} for o in result.options],
        "solve_s": result.solve_s,
    }
