"""The Helm chart (deploy/helm/ampd), rendered by Helm itself: helm-python-sdk binds
Helm's own Go SDK (v4: its chart loader, template engine, values.schema.json validation
and linter) in-process, so `helm template` runs here without the helm binary or a
cluster. Every rendered object is checked against the Kubernetes API's JSON schemas
(kubernetes-validate, strict: an unknown or misspelled field fails), every `ampd` command
the pods run is parsed by ampd's own CLI, and the values come from the chart's defaults
and from `ampd plan --helm-values` (a split deployment and an elastic pool). The pods of
a GPU-free release also run, as local processes with their rendered commands and
environments, and serve a session together. What no test here can do: install the chart
in a cluster, build or pull the images, or start vLLM on GPUs."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import redis
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's Go SDK) is in the dev extra")

from ampd.local_redis import free_port  # noqa: E402
from ampd.processes import tools_worker_ready  # noqa: E402
from perfmodel.catalog import MODELS  # noqa: E402
from perfmodel.profile import Profile, load_profile  # noqa: E402
from planner.plan import HELM_PROFILE_DIR, DeploymentFile, PhaseDeployment, role_plan_json  # noqa: E402
from rounds.elastic import RolePlan, RoleStep  # noqa: E402
from rounds.policies import POLICIES  # noqa: E402
from tests.test_compose import parse_ampd  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "ampd"
KUBE_VERSIONS = ("1.29.0", "1.33.0")  # the schemas every object must pass (kubeVersion >= 1.25)
POD_IP = "10.1.2.3"  # what the downward API gives a pod, for $(POD_IP) in commands
SUITE_REDIS = "redis://127.0.0.1:6379/13"  # the suite's own database (tests/conftest.py)
WORKLOADS = ("Deployment", "StatefulSet")
KEYS_DIR = "/etc/ampd/keys"  # where the gateway pods mount the API keys Secret
KEYS_FILE = f"{KEYS_DIR}/api-keys"

SPLIT = DeploymentFile(
    model="llama-3.1-70b",
    policy="ampd",
    prefill=PhaseDeployment(gpu="H20", tp=2, replicas=3, profile="llama-3.1-70b_h20_tp2"),
    decode=PhaseDeployment(gpu="H20", tp=4, replicas=2, profile="llama-3.1-70b_h20_tp4"),
    ttft_slo_s=1.25,
    itl_slo_s=0.06,
    predicted_slo_attainment=0.97,
    predicted_p95_ttft_s=0.8,
    z=0.4,
)
ELASTIC = DeploymentFile(
    model="llama-3.1-8b",
    policy="elastic",
    pool=PhaseDeployment(gpu="L40", tp=2, replicas=4, profile="/plans/llama-3.1-8b_l40_tp2.json"),
    role_plan=RolePlan((RoleStep(0.5, {1: 0.99, 2: 0.97}), RoleStep(2.0, {2: 0.95, 3: 0.9}))),
    ttft_slo_s=0.2,
    itl_slo_s=0.05,
    itl_rule="p95",
    predicted_slo_attainment=0.95,
    predicted_p95_ttft_s=0.15,
)
DERIVED_PROFILE = load_profile("llama-3.1-8b_h100_tp2").model_dump_json()  # stands in for a derived one


# -- rendering -------------------------------------------------------------------------
def render(values: dict | None = None, name: str = "ampd", namespace: str = "serving") -> dict[str, Any]:
    """`helm template NAME deploy/helm/ampd -n NAMESPACE` with ``values``: the objects by
    (kind, name), each checked against the Kubernetes schemas; NOTES.txt under ("NOTES", "")."""
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values or {})
        manifests = chart.render(values or {}, name=name, namespace=namespace, is_install=True)
    objects: dict[Any, Any] = {("NOTES", ""): manifests.pop(f"{chart_name()}/templates/NOTES.txt", "")}
    for path, text in manifests.items():
        for obj in yaml.safe_load_all(text):
            if obj is None:
                continue
            for version in KUBE_VERSIONS:
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    where = f"{path}: {obj['kind']} {obj['metadata']['name']} on {version}"
                    raise AssertionError(f"{where}: {exc}") from exc
            key = (obj["kind"], obj["metadata"]["name"])
            assert key not in objects, f"{key} rendered twice"
            objects[key] = obj
    check_references(objects)
    return objects


def chart_name() -> str:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())["name"]


def of_kind(objects: dict, kind: str) -> dict[str, dict]:
    return {name: obj for (k, name), obj in objects.items() if k == kind}


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def check_references(objects: dict) -> None:
    """What a cluster would find out only at run time: every Service selects some pods and
    names ports they have, every StatefulSet's service exists, every selector matches its
    template, and every ConfigMap or Secret a pod reads is rendered (or named by the user)."""
    workloads = [o for (k, _), o in objects.items() if k in WORKLOADS]
    for w in workloads:
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items(), w["metadata"]["name"]
        if w["kind"] == "StatefulSet":
            service = objects[("Service", w["spec"]["serviceName"])]
            assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per engine
        spec = pod_spec(w)
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                data = objects[("ConfigMap", volume["configMap"]["name"])]["data"]
                assert all(item["key"] in data for item in volume["configMap"].get("items", [])), volume
        mounted = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        assert mounted == {v["name"] for v in spec.get("volumes", [])}, w["metadata"]["name"]
    for name, service in of_kind(objects, "Service").items():
        selected = [
            w
            for w in workloads
            if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert selected, f"Service {name} selects no pods"
        for port in service["spec"]["ports"]:
            for w in selected:
                names = {p.get("name") for c in pod_spec(w)["containers"] for p in c.get("ports", [])}
                assert port["targetPort"] in names, f"Service {name}: no port {port['targetPort']} in its pods"


def containers(objects: dict) -> dict[str, dict]:
    """Every container by its workload's name (one container each)."""
    out = {}
    for (kind, name), obj in objects.items():
        if kind in WORKLOADS:
            (container,) = pod_spec(obj)["containers"]
            out[name] = container
    return out


def env_of(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def expanded(container: dict, pod_ip: str = POD_IP) -> list[str]:
    """The command as the kubelet runs it: $(VAR) replaced by the container's env."""
    env = {k: v for k, v in env_of(container).items() if isinstance(v, str)}
    env["POD_IP"] = pod_ip
    env.setdefault("REDIS_URL", "redis://from-a-secret:6379/0")
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], arg) for arg in container["command"]]


def check_engine_profile(objects: dict, workload: dict, profile: str) -> None:
    """The engine can load its profile: a shipped one (in both images) or a file mounted
    from the profiles ConfigMap."""
    if not profile.startswith(HELM_PROFILE_DIR + "/"):
        load_profile(profile)
        return
    (mount,) = [m for m in pod_spec(workload)["containers"][0]["volumeMounts"] if m["mountPath"] == HELM_PROFILE_DIR]
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
    data = objects[("ConfigMap", volume["configMap"]["name"])]["data"]
    Profile.model_validate_json(data[Path(profile).name])


def engines(objects: dict) -> dict[str, dict]:
    """StatefulSets by the ampd role their engines register with."""
    return {s["metadata"]["labels"]["ampd.io/role"]: s for s in of_kind(objects, "StatefulSet").values()}


# -- DeploymentFile.helm_values (pure) --------------------------------------------------
@pytest.mark.unit
def test_helm_values_of_a_split_deployment():
    values = SPLIT.helm_values()
    assert values["model"] == "llama-3.1-70b" and values["policy"] == "ampd"
    assert values["engines"]["vllm"]["model"] == MODELS["llama-3.1-70b"].hf_id
    assert values["prefill"] == {"gpu": "H20", "tp": 2, "replicas": 3, "profile": "llama-3.1-70b_h20_tp2"}
    assert values["decode"] == {"gpu": "H20", "tp": 4, "replicas": 2, "profile": "llama-3.1-70b_h20_tp4"}
    assert values["pool"] == {"replicas": 0} and values["profiles"] == {}
    assert values["gateway"] == {"rolePlan": None, "slo": {"ttftS": 1.25, "itlS": 0.06, "itlMetric": "mean"}}
    json.dumps(values)  # plain data: it goes into a values file


@pytest.mark.unit
def test_helm_values_of_an_elastic_pool_carry_its_role_plan_and_derived_profile():
    path = "/plans/llama-3.1-8b_l40_tp2.json"
    values = ELASTIC.helm_values({path: DERIVED_PROFILE})
    assert values["prefill"] == {"replicas": 0} and values["decode"] == {"replicas": 0}
    assert values["pool"] == {
        "gpu": "L40",
        "tp": 2,
        "replicas": 4,
        "profile": f"{HELM_PROFILE_DIR}/llama-3.1-8b_l40_tp2.json",
    }
    assert values["profiles"] == {"llama-3.1-8b_l40_tp2.json": DERIVED_PROFILE}
    assert values["gateway"]["rolePlan"] == json.loads(role_plan_json(ELASTIC.role_plan))
    assert values["gateway"]["slo"]["itlMetric"] == "p95"  # judged as it was planned
    with pytest.raises(ValueError, match="not in the images"):
        ELASTIC.helm_values()  # a file the cluster cannot see, and no text to send it in


# -- the chart, rendered ----------------------------------------------------------------
@pytest.mark.unit
def test_chart_lints_and_defaults_validate():
    report = helm.lint(str(CHART), strict=True, kube_version="v1.30.0")
    errors = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]  # warnings fail too
    assert not errors, errors
    with helm.Chart.load(CHART) as chart:
        assert chart.values == yaml.safe_load((CHART / "values.yaml").read_text())
        chart.validate_schema(chart.values)


@pytest.mark.unit
def test_default_values_render_compose_as_kubernetes_objects():
    objects = render()
    gateway = objects[("Deployment", "ampd-gateway")]
    assert gateway["spec"]["replicas"] == 2
    budget = objects[("PodDisruptionBudget", "ampd-gateway")]["spec"]
    assert budget["minAvailable"] == 1 and budget["selector"] == gateway["spec"]["selector"]
    (port,) = objects[("Service", "ampd-gateway")]["spec"]["ports"]
    assert port["port"] == 8000
    run = containers(objects)
    assert set(run) == {"ampd-gateway", "ampd-redis", "ampd-tools", "ampd-prefill", "ampd-decode"}
    # Redis in the release, and every ampd process pointed at its Service.
    assert run["ampd-redis"]["command"] == ["redis-server", "--save", "", "--appendonly", "no"]  # as compose's
    for name in ("ampd-gateway", "ampd-tools", "ampd-prefill", "ampd-decode"):
        assert env_of(run[name])["REDIS_URL"] == "redis://ampd-redis:6379/0", name
    assert ("Service", "ampd-redis") in objects
    # The same images as compose: ampd's for the gateway and tools, vLLM's for the engines.
    assert run["ampd-gateway"]["image"] == run["ampd-tools"]["image"] == "ampd:latest"
    assert run["ampd-prefill"]["image"] == run["ampd-decode"]["image"] == "ampd-vllm:latest"
    tools = parse_ampd(expanded(run["ampd-tools"]))
    assert tools.params["workers"] == 2 and run["ampd-tools"]["securityContext"]["readOnlyRootFilesystem"]
    check_gateway(objects, "ampd")
    check_vllm_engines(objects, {"prefill": (1, "llama-3.1-8b_h100_tp1"), "decode": (1, "llama-3.1-8b_h100_tp1")})
    check_monitoring(objects)
    assert "prefill: 1 x TP 1 on H100" in objects[("NOTES", "")]


def check_gateway(objects: dict, policy: str) -> Any:
    container = containers(objects)["ampd-gateway"]
    ctx = parse_ampd(expanded(container))
    assert not ctx.args, f"options `ampd gateway` does not know: {ctx.args}"
    assert ctx.params["policy"] == policy and policy in POLICIES
    assert ctx.params["host"] == "0.0.0.0" and ctx.params["port"] == 8000
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == "/readyz" and probe["port"] == "http"
    return ctx


def check_vllm_engines(objects: dict, pools: dict[str, tuple[int, str]], tp: dict[str, int] | None = None) -> None:
    """One StatefulSet per pool, its engines `ampd worker vllm` with the pool's role, TP
    GPUs each, NIXL's side channel on the pod's own address, registered in Redis."""
    by_role = engines(objects)
    assert set(by_role) == set(pools)
    for role, (replicas, profile) in pools.items():
        workload = by_role[role]
        assert workload["spec"]["replicas"] == replicas
        (container,) = pod_spec(workload)["containers"]
        ctx = parse_ampd(expanded(container))
        assert ctx.info_name.endswith("vllm") and not ctx.args, ctx.args
        p = ctx.params
        assert p["role"] == role and p["profile"] == profile and p["port"] == 8000
        gpus = (tp or {}).get(role, 1)
        assert p["tp"] == gpus
        for bound in ("limits", "requests"):
            assert container["resources"][bound]["nvidia.com/gpu"] == gpus
        # NIXL: the supervisor sets VLLM_NIXL_SIDE_CHANNEL_HOST/PORT from these (workers/vllm/launch.py),
        # and the kv-transfer config (NixlConnector, kv_both) itself.
        assert p["advertise_host"] == POD_IP and p["side_channel_port"] == 5600
        env = env_of(container)
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert {"UCX_TLS", "UCX_NET_DEVICES"} <= set(env)
        assert p["redis_url"] == env["REDIS_URL"] or "secretKeyRef" in env["REDIS_URL"]
        assert {port["name"]: port["containerPort"] for port in container["ports"]} == {"http": 8000, "nixl": 5600}
        assert pod_spec(workload)["terminationGracePeriodSeconds"] > p["drain_timeout"]  # SIGTERM drains first
        assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])
        check_engine_profile(objects, workload, profile)


def check_monitoring(objects: dict) -> None:
    dashboard = objects[("ConfigMap", "ampd-grafana-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "ampd.json").read_text())
    assert json.loads(dashboard["data"]["ampd.json"]) == shipped
    config = yaml.safe_load(objects[("ConfigMap", "ampd-prometheus")]["data"]["prometheus.yml"])
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"gateway", "prefill", "decode", "pool"}  # deploy/prometheus.yml's
    for (kind, _), obj in objects.items():
        if kind in WORKLOADS and obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] in (
            "gateway",
            "engine-prefill",
            "engine-decode",
            "engine-pool",
        ):
            annotations = obj["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8000"


@pytest.mark.unit
def test_prometheus_and_grafana_as_compose_runs_them():
    objects = render({"monitoring": {"prometheus": {"enabled": True}, "grafana": {"enabled": True}}})
    run = containers(objects)
    assert run["ampd-prometheus"]["image"] == "prom/prometheus:v3.0.1"  # compose.yaml's images
    assert run["ampd-grafana"]["image"] == "grafana/grafana:11.4.0"
    # Prometheus discovers this release's pods in its namespace, with a Role to list them.
    prometheus = pod_spec(objects[("Deployment", "ampd-prometheus")])
    account = prometheus["serviceAccountName"]
    binding = objects[("RoleBinding", account)]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "serving"}]
    (rule,) = objects[("Role", binding["roleRef"]["name"])]["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    config = yaml.safe_load(objects[("ConfigMap", "ampd-prometheus")]["data"]["prometheus.yml"])
    selectors = []
    for job in config["scrape_configs"]:
        (sd,) = job["kubernetes_sd_configs"]
        assert sd["role"] == "pod" and sd["namespaces"]["names"] == ["serving"]
        selectors.append(dict(pair.split("=") for pair in sd["selectors"][0]["label"].split(",")))
    for name in ("ampd-gateway", "ampd-prefill", "ampd-decode"):
        labels = objects[(objects_kind(objects, name), name)]["spec"]["template"]["metadata"]["labels"]
        assert any(s.items() <= labels.items() for s in selectors), f"no scrape job finds {name}"
    # Grafana: deploy/grafana/provisioning, its datasource this release's Prometheus.
    data = objects[("ConfigMap", "ampd-grafana-provisioning")]["data"]
    (source,) = yaml.safe_load(data["datasources.yaml"])["datasources"]
    service = objects[("Service", "ampd-prometheus")]["spec"]["ports"][0]
    assert source["url"] == f"http://ampd-prometheus:{service['port']}"
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    (shipped,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert {**source, "url": shipped["url"]} == shipped
    provider = yaml.safe_load(data["dashboards.yaml"])
    assert provider == yaml.safe_load((provisioning / "dashboards" / "ampd.yaml").read_text())
    mounts = {m["name"]: m["mountPath"] for m in run["ampd-grafana"]["volumeMounts"]}
    assert mounts["dashboards"] == provider["providers"][0]["options"]["path"]


def objects_kind(objects: dict, name: str) -> str:
    (kind,) = [k for (k, n) in objects if n == name and k in WORKLOADS]
    return kind


@pytest.mark.unit
def test_the_chart_ships_deploy_grafanas_dashboard_unchanged():
    shipped = ROOT / "deploy" / "grafana" / "dashboards" / "ampd.json"
    assert (CHART / "files" / "grafana-dashboard.json").read_bytes() == shipped.read_bytes()


@pytest.mark.unit
def test_a_split_plan_renders_its_pools_policy_and_slos():
    values = SPLIT.helm_values() | {
        "gateway": SPLIT.helm_values()["gateway"] | {"apiKeys": ["k-one", "sha256:" + "a" * 64]}
    }
    objects = render(values)
    ctx = check_gateway(objects, "ampd")
    assert ctx.params["ttft_slo"] == 1.25 and ctx.params["itl_slo"] == 0.06
    check_vllm_engines(
        objects,
        {"prefill": (3, "llama-3.1-70b_h20_tp2"), "decode": (2, "llama-3.1-70b_h20_tp4")},
        {"prefill": 2, "decode": 4},
    )
    for workload in engines(objects).values():
        ctx = parse_ampd(expanded(pod_spec(workload)["containers"][0]))
        assert ctx.params["model"] == "meta-llama/Llama-3.1-70B-Instruct"
        assert ctx.params["served_model_name"] == "llama-3.1-70b"
    # API keys: a Secret, never in the pod spec, mounted whole (a subPath mount would never see
    # an update) as the file the gateway re-reads, one key a line.
    gateway = objects[("Deployment", "ampd-gateway")]
    assert parse_ampd(expanded(containers(objects)["ampd-gateway"])).params["api_keys_file"] == Path(KEYS_FILE)
    assert {"name": "api-keys", "mountPath": KEYS_DIR, "readOnly": True} in pod_spec(gateway)["containers"][0][
        "volumeMounts"
    ]
    (volume,) = [v for v in pod_spec(gateway)["volumes"] if v["name"] == "api-keys"]
    secret = objects[("Secret", volume["secret"]["secretName"])]
    assert secret["stringData"]["api-keys"].splitlines() == ["k-one", "sha256:" + "a" * 64]
    assert "k-one" not in json.dumps(gateway)


@pytest.mark.unit
def test_operator_settings_reach_vllm_and_the_gateway():
    extra = ["--gpu-memory-utilization", "0.9", "--max-model-len=32768"]
    vllm = {"extraArgs": extra, "hfTokenSecret": "hf-token", "hfCache": {"existingClaim": "hf-cache"}}
    names = ["llama-3.1-8b", "llama"]
    gateway_values = {"extraArgs": ["--max-tool-rounds=4"], "existingSecret": "keys", "servedModelNames": names}
    objects = render({"engines": {"vllm": vllm}, "gateway": gateway_values})
    gateway = containers(objects)["ampd-gateway"]
    assert parse_ampd(expanded(gateway)).params["max_tool_rounds"] == 4
    assert parse_ampd(expanded(gateway)).params["served_model_name"] == names
    assert not parse_ampd(expanded(containers(render())["ampd-gateway"])).params["served_model_name"]  # none by default
    (volume,) = [v for v in pod_spec(objects[("Deployment", "ampd-gateway")])["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"] == {"secretName": "keys"}
    assert parse_ampd(expanded(gateway)).params["api_keys_file"] == Path(KEYS_FILE)
    assert "--api-keys-file" not in " ".join(containers(render())["ampd-gateway"]["command"])  # no keys: open
    for workload in engines(objects).values():
        (container,) = pod_spec(workload)["containers"]
        assert parse_ampd(expanded(container)).args == extra  # after `--`: vLLM's, unchanged
        assert env_of(container)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}
        (cache,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == "hf-cache"]
        assert cache["persistentVolumeClaim"] == {"claimName": "hf-cache"}


@pytest.mark.unit
def test_an_elastic_plan_renders_one_pool_and_the_gateways_role_plan():
    values = ELASTIC.helm_values({"/plans/llama-3.1-8b_l40_tp2.json": DERIVED_PROFILE})
    objects = render(values)
    check_gateway(objects, "elastic")
    plan = env_of(containers(objects)["ampd-gateway"])["AMPD_ROLE_PLAN"]
    assert json.loads(plan) == json.loads(role_plan_json(ELASTIC.role_plan))  # what --role-plan parses
    profile = f"{HELM_PROFILE_DIR}/llama-3.1-8b_l40_tp2.json"
    check_vllm_engines(objects, {"both": (4, profile)}, {"both": 2})
    assert not any(p in objects for p in (("StatefulSet", "ampd-prefill"), ("StatefulSet", "ampd-decode")))


@pytest.mark.unit
def test_gpu_free_engines_external_redis_and_gpu_node_selection():
    values = SPLIT.helm_values() | {
        "engines": {"kind": "sim", "sim": {"speed": 20}},
        "redis": {"enabled": False, "url": "redis://redis.shared:6379/3"},
    }
    objects = render(values)
    assert ("Deployment", "ampd-redis") not in objects
    for role, workload in engines(objects).items():
        (container,) = pod_spec(workload)["containers"]
        ctx = parse_ampd(expanded(container))
        assert ctx.info_name.endswith("sim") and not ctx.args
        assert ctx.params["role"] == role and ctx.params["speed"] == 20 and ctx.params["advertise_host"] == POD_IP
        assert ctx.params["redis_url"] == "redis://redis.shared:6379/3"
        assert "resources" not in container and container["image"] == "ampd:latest"  # no GPU asked for
    on_gpus = render(
        SPLIT.helm_values()
        | {"engines": {"gpuNodeLabel": "nvidia.com/gpu.product", "gpuProducts": {"H20": "NVIDIA-H20"}}}
    )
    for workload in engines(on_gpus).values():
        assert pod_spec(workload)["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H20"}
    secret = render({"redis": {"enabled": False, "existingSecret": "shared-redis"}})
    ref = env_of(containers(secret)["ampd-gateway"])["REDIS_URL"]
    assert ref == {"secretKeyRef": {"name": "shared-redis", "key": "url"}}


@pytest.mark.unit
def test_a_redis_that_sentinel_manages_reaches_every_process():
    url = "redis+sentinel://sentinel-0.redis:26379,sentinel-1.redis:26379,sentinel-2.redis/ampd/0"
    objects = render(SPLIT.helm_values() | {"engines": {"kind": "sim"}, "redis": {"enabled": False, "url": url}})
    assert ("Deployment", "ampd-redis") not in objects
    for name, container in containers(objects).items():
        assert env_of(container)["REDIS_URL"] == url, name
    for workload in engines(objects).values():
        (container,) = pod_spec(workload)["containers"]
        assert parse_ampd(expanded(container)).params["redis_url"] == url  # the CLI reads it (and would refuse)


def test_a_plan_that_sizes_steps_starts_every_engine_with_its_target():
    """dynaserve under the P95 rule: ampd's scheduler in vLLM, and the GPU-free engines alike,
    start with the plan's step target (the gateways assign it too); the default plan starts
    them with none."""
    sized = SPLIT.model_copy(update={"policy": "dynaserve", "itl_rule": "p95"})
    assert sized.step_target_ms > 0
    assert sized.helm_values()["engines"]["stepTargetMs"] == pytest.approx(sized.step_target_ms, abs=1e-3)
    for kind in ("vllm", "sim"):
        values = sized.helm_values()
        values["engines"]["kind"] = kind
        for workload in engines(render(values)).values():
            (container,) = pod_spec(workload)["containers"]
            assert parse_ampd(expanded(container)).params["step_target_ms"] == pytest.approx(sized.step_target_ms,
                                                                                          abs=1e-3)  # fmt: skip
    for workload in engines(render(SPLIT.helm_values())).values():
        (container,) = pod_spec(workload)["containers"]
        assert parse_ampd(expanded(container)).params["step_target_ms"] == 0  # none until a gateway assigns one


@pytest.mark.unit
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"prefill": {"tp": 0}}, "minimum"),  # values.schema.json
        ({"gateway": {"replicsa": 3}}, "replicsa"),  # a misspelled value
        ({"engines": {"kind": "cpu"}}, "kind"),
        ({"gateway": {"slo": {"itlMetric": "p99"}}}, "itlMetric"),
        ({"redis": {"enabled": False}}, "redis.url"),  # the template's `required`
        ({"policy": "elastic"}, "pool.replicas"),  # an elastic policy with no pool to move
        ({"gateway": {"rolePlan": json.loads(role_plan_json(ELASTIC.role_plan))}}, "elastic policy"),
    ],
)
def test_broken_values_fail_to_render(values, message):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError, match=message):
        chart.render(values, name="ampd", namespace="serving")


@pytest.mark.unit
def test_the_chart_knows_which_policies_are_elastic():
    template = (CHART / "templates" / "gateway.yaml").read_text()
    assert 'hasPrefix "elastic" .Values.policy' in template
    assert {p for p in POLICIES if p.startswith("elastic")} == {p for p, v in POLICIES.items() if v.elastic is not None}


# -- `ampd plan --helm-values`, end to end ------------------------------------------------
def test_ampd_plan_writes_values_the_chart_renders(tmp_path: Path):
    def ampd(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "ampd.cli", *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    trace = tmp_path / "tb.jsonl"
    ampd("trace", "generate", "--out", str(trace), "--sessions", "40", "--rate", "0.4")
    split, elastic = tmp_path / "split", tmp_path / "elastic"
    ampd("plan", "--trace", str(trace), "--gpus", "8", "--candidates", "3", "--out", str(split / "deployment.json"),
         "--helm-values", str(split / "values.yaml"))  # fmt: skip
    # L40 profiles are derived on the fly (none shipped): the plan's file travels in the values.
    ampd("plan", "--trace", str(trace), "--gpus", "4", "--gpu-type", "L40", "--model", "llama-3.1-8b",
         "--policy", "elastic", "--out", str(elastic / "deployment.json"),
         "--helm-values", str(elastic / "values.yaml"))  # fmt: skip
    for folder in (split, elastic):
        text = (folder / "values.yaml").read_text()
        values = helm.values_from_yaml(text)  # Helm's own reading of the file `helm install -f` gets
        assert values == yaml.safe_load(text)
        deployment = DeploymentFile.model_validate_json((folder / "deployment.json").read_text())
        objects = render(values)
        check_gateway(objects, deployment.policy)
        pools = {
            role: (phase.replicas, values[name]["profile"])
            for role, name, phase in (
                ("prefill", "prefill", deployment.prefill),
                ("decode", "decode", deployment.decode),
                ("both", "pool", deployment.pool),
            )
            if phase is not None
        }
        tps = {role: values[{"both": "pool"}.get(role, role)]["tp"] for role in pools}
        check_vllm_engines(objects, pools, tps)
    assert values["pool"]["profile"].startswith(HELM_PROFILE_DIR)  # the elastic plan's derived profile


# -- the rendered pods, run as processes ------------------------------------------------
def test_the_rendered_pods_serve_together(tmp_path: Path):
    """No cluster here, so the pods of a GPU-free elastic release run as local processes,
    each with its container's own command and environment as the kubelet would expand them
    - its pod IP 127.0.0.1, its port 8000 moved to a free one (pods have an IP each; here
    they share one), the profiles ConfigMap written where the pod mounts it - against the
    suite's Redis: two gateway replicas, a pool of two engines, a tools worker. They must
    find each other through Redis as on a cluster, and serve keys from the Secret."""
    prefix = f"helm-{uuid.uuid4().hex[:8]}"
    derived = "/plans/llama-3.1-8b_l40_tp1.json"
    deployment = DeploymentFile(
        model="llama-3.1-8b", policy="elastic",
        pool=PhaseDeployment(gpu="L40", tp=1, replicas=2, profile=derived),
        role_plan=RolePlan((RoleStep(0.5, {0: 0.9, 1: 0.99}),)),
        ttft_slo_s=2.0, itl_slo_s=0.2, predicted_slo_attainment=0.99, predicted_p95_ttft_s=0.3,
    )  # fmt: skip
    values = deployment.helm_values({derived: load_profile("llama-3.1-8b_h100_tp1").model_dump_json()})
    values["engines"] = {"kind": "sim", "sim": {"speed": 50}}
    values["redis"] = {"enabled": False, "url": SUITE_REDIS, "prefix": prefix}
    values["gateway"] |= {"apiKeys": ["key-plain", "sha256:" + hashlib.sha256(b"key-hashed").hexdigest()]}
    objects = render(values)
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    for file, text in objects[("ConfigMap", "ampd-profiles")]["data"].items():
        (profiles / file).write_text(text)
    keys = tmp_path / "keys"  # the Secret as the gateway pods mount it
    keys.mkdir()
    for file, text in objects[("Secret", "ampd-api-keys")]["stringData"].items():
        (keys / file).write_text(text)

    def run(workload: str, replica: int) -> tuple[subprocess.Popen, str | None]:
        container = containers(objects)[workload]
        env = {}
        for name, value in env_of(container).items():
            if isinstance(value, dict) and "secretKeyRef" in value:
                ref = value["secretKeyRef"]
                value = objects[("Secret", ref["name"])]["stringData"][ref["key"]]
            if isinstance(value, str):
                env[name] = value
        argv, url = [], None
        for arg in expanded(container, pod_ip="127.0.0.1"):
            if arg == "--port=8000":
                port = free_port()
                arg, url = f"--port={port}", f"http://127.0.0.1:{port}"
            argv.append(arg.replace(HELM_PROFILE_DIR, str(profiles)).replace(KEYS_DIR, str(keys)))
        assert argv[0] == "ampd"
        log = (tmp_path / f"{workload}-{replica}.log").open("ab")
        process = subprocess.Popen(
            [sys.executable, "-m", "ampd.cli", *argv[1:]], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **env}, start_new_session=True,
        )  # fmt: skip
        started.append(process)
        return process, url

    def healthy(url: str, path: str, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + path, timeout=2).status_code == 200:
                    return True
            time.sleep(0.2)
        return False

    def logs() -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))

    started: list[subprocess.Popen] = []
    try:
        replicas = {name: obj["spec"]["replicas"] for (kind, name), obj in objects.items() if kind in WORKLOADS}
        assert replicas == {"ampd-gateway": 2, "ampd-pool": 2, "ampd-tools": 1}
        engine_urls = [run("ampd-pool", i)[1] for i in range(2)]
        tools, _ = run("ampd-tools", 0)
        assert all(healthy(url, "/health") for url in engine_urls), logs()
        assert tools_worker_ready(SUITE_REDIS, prefix, tools), logs()
        gateways = [run("ampd-gateway", i)[1] for i in range(2)]
        assert all(healthy(url, "/readyz") for url in gateways), logs()
        store, deadline = redis.Redis.from_url(SUITE_REDIS), time.monotonic() + 60
        while len(registered := store.smembers(f"{prefix}:workers")) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # an engine registers once it serves: moments after its /health answers
        assert len(registered) == 2, registered  # both engines, found through Redis as on a cluster

        script = {"rounds": [{"tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]}, {}]}
        ask = {"model": "llama-3.1-8b", "server_tools": ["calculator"], "sim_script": script,
               "messages": [{"role": "user", "content": "What is six times seven?"}]}  # fmt: skip
        bearer = {"Authorization": "Bearer key-plain", "X-Session-Id": f"{prefix}-s"}
        first = httpx.post(f"{gateways[0]}/v1/chat/completions", json=ask, headers=bearer, timeout=60)
        assert first.status_code == 200, first.text + logs()
        (tool_round,) = first.json()["ampd_tool_rounds"]
        assert tool_round["calls"][0]["ok"], tool_round  # the tools worker ran it
        # The other replica continues the session (shared in Redis); the hashed key is accepted.
        follow = {"model": "llama-3.1-8b", "messages": [*ask["messages"], first.json()["choices"][0]["message"],
                                                        {"role": "user", "content": "And 6*8?"}]}  # fmt: skip
        again = httpx.post(f"{gateways[1]}/v1/chat/completions", json=follow, headers=bearer, timeout=60)
        assert again.status_code == 200, again.text
        assert again.headers["X-AMPD-Decode-Worker"] == first.headers["X-AMPD-Decode-Worker"]  # its binding
        other = {"Authorization": "Bearer key-hashed"}
        assert (
            httpx.post(f"{gateways[1]}/v1/chat/completions", json=follow, headers=other, timeout=60).status_code == 200
        )
        assert httpx.post(f"{gateways[1]}/v1/chat/completions", json=follow, timeout=60).status_code == 401
    finally:
        for process in reversed(started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in started:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
