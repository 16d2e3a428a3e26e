"""compose.yaml, read as docker compose would read it: there is no Docker engine here,
so these tests check that every command it runs is a real `ampd` command with options
that parse, every file it mounts or builds from exists, and a deployment file from
`ampd plan` sets the pools' size and parallelism."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from ampd.cli import app
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from perfmodel.profile import load_profile
from perfmodel.slo import BETA, SLO
from planner.plan import DeploymentFile, PhaseDeployment
from rounds.elastic import RolePlan, RoleStep
from rounds.policies import POLICIES, step_target

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ``${NAME}`` and ``${NAME:-default}`` (``$$`` is a literal dollar)."""
    if isinstance(value, str):
        return VARIABLE.sub(lambda m: env.get(m[1]) or (m[2] or ""), value).replace("$$", "$")
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def services(env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return interpolate(compose, env or {})["services"]


def parse_ampd(argv: list[str]) -> Any:
    """Parse an `ampd ...` command line as the CLI would, without running it (a bad
    option or value raises); returns the leaf command's context."""
    assert argv[0] == "ampd", argv
    command, args = typer.main.get_command(app), argv[1:]
    while hasattr(command, "commands"):  # a group: descend by name
        name, *args = args
        assert name in command.commands, f"no command `{name}` in {' '.join(argv)}"
        command = command.commands[name]
    return command.make_context(" ".join(argv[1:3]), list(args))


def test_every_command_is_a_real_ampd_command():
    commands = {name: s["command"] for name, s in services().items() if s.get("command", [""])[0] == "ampd"}
    assert {"gateway", "tools", "prefill", "decode", "prefill-cpu", "decode-cpu", "pool", "pool-cpu"} <= set(commands)
    for name, argv in commands.items():
        ctx = parse_ampd(argv)
        assert not ctx.args, f"{name}: options ampd does not know (passed on to vLLM): {ctx.args}"
        if "profile" in ctx.params:
            load_profile(ctx.params["profile"])  # the worker would refuse to start otherwise
        if "role" in ctx.params:
            base = name.removesuffix("-cpu")
            assert ctx.params["role"] == ("both" if base == "pool" else base), name


def test_gpu_and_cpu_workers_are_separate_profiles():
    all_services = services()
    for role in ("prefill", "decode", "pool"):
        gpu, cpu = all_services[role], all_services[f"{role}-cpu"]
        assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
        (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert "UCX_TLS" in gpu["environment"]
        assert gpu["command"][:3] == ["ampd", "worker", "vllm"] and cpu["command"][:3] == ["ampd", "worker", "sim"]
    unprofiled = {name for name, s in all_services.items() if "profiles" not in s}
    assert unprofiled == {"redis", "gateway", "tools", "otel-collector", "jaeger", "prometheus", "grafana"}
    assert "COMPOSE_PROFILES=gpu" in (ROOT / ".env").read_text()


def test_a_deployment_file_sets_pool_sizes_and_parallelism():
    plan = DeploymentFile(
        model="llama-3.1-70b", policy="ampd-routing-only",
        prefill=PhaseDeployment(gpu="H20", tp=2, replicas=3, profile="llama-3.1-70b_h20_tp2"),
        decode=PhaseDeployment(gpu="H20", tp=4, replicas=1, profile="llama-3.1-70b_h20_tp4"),
        ttft_slo_s=5.0, itl_slo_s=0.1, predicted_slo_attainment=0.9, predicted_p95_ttft_s=1.0, z=1.0,
    )  # fmt: skip
    env = dict(line.split("=", 1) for line in plan.env().splitlines())
    planned = services(env)
    for role, phase in (("prefill", plan.prefill), ("decode", plan.decode)):
        for name in (role, f"{role}-cpu"):
            assert planned[name]["deploy"]["replicas"] == str(phase.replicas)
            params = parse_ampd(planned[name]["command"]).params
            assert params["profile"] == phase.profile and params["served_model_name"] == plan.model
        assert parse_ampd(planned[role]["command"]).params["tp"] == phase.tp
        assert planned[role]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == str(phase.tp)
    assert "--policy=ampd-routing-only" in planned["gateway"]["command"]
    assert "--itl-slo-metric=mean" in planned["gateway"]["command"]
    assert planned["pool"]["deploy"]["replicas"] == planned["pool-cpu"]["deploy"]["replicas"] == "0"
    assert parse_ampd(planned["gateway"]["command"]).params["role_plan"] in ("", None)


@pytest.mark.parametrize("policy, rule", [("dynaserve", "p95"), ("ampd", "p95"), ("dynaserve", "mean")])
def test_a_policy_that_sizes_steps_hands_every_engine_its_target(monkeypatch, policy, rule):
    """Step sizing where the simulator judged the plan with it (rounds.policies.step_target):
    the target reaches vLLM engines (ampd's scheduler) and GPU-free ones alike at start (the
    gateways assign it too); elsewhere they start with none."""
    plan = DeploymentFile(
        model="llama-3.1-70b", policy=policy, itl_rule=rule,
        prefill=PhaseDeployment(gpu="H20", tp=2, replicas=1, profile="llama-3.1-70b_h20_tp2"),
        decode=PhaseDeployment(gpu="H20", tp=4, replicas=1, profile="llama-3.1-70b_h20_tp4"),
        ttft_slo_s=5.0, itl_slo_s=0.1, predicted_slo_attainment=0.9, predicted_p95_ttft_s=1.0,
    )  # fmt: skip
    expected = 1000 * step_target(POLICIES[policy], SLO(5.0, 0.1), rule, BETA)
    assert plan.step_target_ms == pytest.approx(expected) and (expected > 0) == ((policy, rule) == ("dynaserve", "p95"))
    planned = services(dict(line.split("=", 1) for line in plan.env().splitlines()))
    for name in ("prefill", "decode", "pool", "prefill-cpu", "decode-cpu", "pool-cpu"):
        monkeypatch.setenv("AMPD_STEP_TARGET_MS", planned[name]["environment"]["AMPD_STEP_TARGET_MS"])
        given = parse_ampd(planned[name]["command"]).params["step_target_ms"]
        assert given == (pytest.approx(expected, abs=1e-3) if expected else 0.0), name  # 0: none until assigned


def test_an_elastic_deployment_file_starts_one_pool_and_hands_the_gateway_its_plan():
    plan = RolePlan((RoleStep(1.0, {0: 0.99, 2: 0.97}), RoleStep(3.0, {0: 0.4, 2: 0.9})))
    elastic = DeploymentFile(
        model="llama-3.1-70b", policy="elastic",
        pool=PhaseDeployment(gpu="H20", tp=2, replicas=4, profile="llama-3.1-70b_h20_tp2"), role_plan=plan,
        ttft_slo_s=5.0, itl_slo_s=0.1, itl_rule="p95", predicted_slo_attainment=0.9, predicted_p95_ttft_s=1.0,
    )  # fmt: skip
    env = {}
    for line in elastic.env().splitlines():  # docker compose strips the single quotes of a value
        name, _, value = line.partition("=")
        env[name] = value.strip("'")
    planned = services(env)
    assert planned["prefill"]["deploy"]["replicas"] == planned["decode-cpu"]["deploy"]["replicas"] == "0"
    for name in ("pool", "pool-cpu"):
        assert planned[name]["deploy"]["replicas"] == "4"
        assert parse_ampd(planned[name]["command"]).params["profile"] == "llama-3.1-70b_h20_tp2"
    assert parse_ampd(planned["pool"]["command"]).params["tp"] == 2
    gateway = parse_ampd(planned["gateway"]["command"]).params
    assert gateway["policy"] == "elastic" and gateway["itl_slo_metric"] == "p95"  # the rule it was planned by
    assert GatewayConfig(policy="elastic", role_plan=json.loads(gateway["role_plan"])).role_plan == plan
    with pytest.raises(ValueError, match="one pool"):
        DeploymentFile.model_validate({**elastic.model_dump(), "decode": elastic.pool.model_dump()})


def test_files_it_builds_and_mounts_exist():
    for name, service in services().items():
        if "build" in service:
            dockerfile = ROOT / service["build"]["context"] / service["build"]["dockerfile"]
            for line in dockerfile.read_text().splitlines():
                if line.startswith("COPY "):
                    for source in line.split()[1:-1]:
                        assert (ROOT / source).exists(), f"{dockerfile.name} copies missing {source}"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"


def test_every_image_copies_every_package_it_installs():
    """A package the project installs but an image does not copy fails only at import, in the
    container (the house's move of the round core to rounds/ and surface/ once did)."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include}
    for dockerfile in {ROOT / s["build"]["context"] / s["build"]["dockerfile"] for s in services().values()
                       if "build" in s}:  # fmt: skip
        copied = {Path(source).name for line in dockerfile.read_text().splitlines() if line.startswith("COPY ")
                  for source in line.split()[1:-1]}  # fmt: skip
        assert packages <= copied, f"{dockerfile.name} does not copy {sorted(packages - copied)}"


def test_telemetry_wiring_points_at_services_that_exist():
    all_services = services()
    gateway = parse_ampd(all_services["gateway"]["command"]).params
    assert gateway["otlp_endpoint"].split("//")[1].split(":")[0] in all_services
    collector = yaml.safe_load((ROOT / "deploy/otel-collector.yaml").read_text())
    assert collector["exporters"]["otlp/jaeger"]["endpoint"].split(":")[0] in all_services
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    scraped = {n for job in prometheus["scrape_configs"] for sd in job["dns_sd_configs"] for n in sd["names"]}
    assert scraped == {"gateway", "prefill", "decode", "prefill-cpu", "decode-cpu", "pool", "pool-cpu"}


@pytest.mark.parametrize(
    "metric",
    [
        "ampd_ttft_seconds",
        "ampd_itl_seconds",
        "ampd_route_total",
        "ampd_slo_rounds_total",
        "ampd_worker_role",
        "ampd_role_moves_total",
        "ampd_prompt_count_checks_total",
    ],  # fmt: skip
)
def test_the_dashboard_charts_what_the_gateway_exports(metric):
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/ampd.json").read_text())
    expressions = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    exposition = GatewayMetrics(roles=lambda: [("engine-0", "decode")]).exposition().decode()
    exported = set(re.findall(r"^# TYPE (\w+) ", exposition, re.M))
    charted = {name.removesuffix("_bucket") for name in re.findall(r"\bampd_\w+", expressions)}
    assert metric in charted and charted <= exported, charted - exported
