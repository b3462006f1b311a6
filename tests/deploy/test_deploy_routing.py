"""deploy/inference-gateway and deploy/router, without a cluster: both render with
`kubectl kustomize`; built-in kinds validate against the Kubernetes schema, the custom ones
(InferencePool, HTTPRoute) against their CRDs' schemas (tests/deploy/data/crds, strict: an unknown
field fails as the API server's strict field validation would); and the pieces point at each
other: pool -> Slipstream pods' OpenAI port and the endpoint picker, route -> pool, picker ->
Slipstream's metric names and metrics port, router -> the pods by label."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from slipstream.server.stub.metrics import GAUGES, PREFIX
from deploy_support import (
    DEPLOY,
    find,
    plain_env,
    render,
    require_module,
    require_tool,
    served_crd_schema,
)

WAYS = ("inference-gateway", "router")
CRDS = Path(__file__).parent / "data" / "crds"
CRD_FILES = {
    (
        "inference.networking.k8s.io",
        "InferencePool",
    ): "inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",
}
KUBERNETES_VERSIONS = ("1.29.0", None)


def crd_schema(api_version: str, kind: str) -> dict:
    group, _ = api_version.split("/")
    return served_crd_schema(CRDS / CRD_FILES[(group, kind)], api_version)


def validate_custom(obj: dict) -> None:
    jsonschema = require_module("jsonschema")
    jsonschema.validate(obj, crd_schema(obj["apiVersion"], obj["kind"]))


def is_custom(obj: dict) -> bool:
    return (obj["apiVersion"].split("/")[0], obj["kind"]) in CRD_FILES


def slipstream_container(objects: tuple) -> dict:
    pod = find(objects, "Deployment", "slipstream")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "slipstream")


def container_port(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def pod_labels(objects: tuple, name: str) -> dict:
    return find(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]


# ------------------------------------------------------------------------------- validity
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_builtin_objects_validate_against_the_kubernetes_schema(way, version):
    kubernetes_validate = require_module("kubernetes_validate")
    version = version or kubernetes_validate.latest_version()
    # ServiceMonitor (from overlays/cpu) is checked in test_deploy.py
    builtin = [o for o in render(way) if not is_custom(o) and o["kind"] != "ServiceMonitor"]
    for obj in builtin:
        kubernetes_validate.validate(obj, version, strict=True)
    assert {"Deployment", "Service"} <= {o["kind"] for o in builtin}


def test_custom_objects_validate_against_their_crd_schemas():
    objects = render("inference-gateway")
    custom = [o for o in objects if is_custom(o)]
    assert sorted(o["kind"] for o in custom) == ["HTTPRoute", "InferencePool"]
    for obj in custom:
        validate_custom(obj)


@pytest.mark.parametrize("kind", ["InferencePool", "HTTPRoute"])
def test_crd_validation_rejects_a_misspelled_field(kind):
    jsonschema = require_module("jsonschema")
    obj = yaml.safe_load(yaml.safe_dump(find(render("inference-gateway"), kind)))
    obj["spec"]["targetPort" if kind == "InferencePool" else "rule"] = []
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(obj)


# ------------------------------------------------------------------------------- the gateway
def test_inference_pool_selects_the_slipstream_pods_at_their_openai_port():
    objects = render("inference-gateway")
    pool = find(objects, "InferencePool")["spec"]
    selector = pool["selector"]["matchLabels"]
    assert selector.items() <= pod_labels(objects, "slipstream").items()
    assert not selector.items() <= pod_labels(objects, "slipstream-epp").items()
    container = slipstream_container(objects)
    (target,) = pool["targetPorts"]
    assert target["number"] == container_port(container, "openai")
    assert plain_env(container)["SLIPSTREAM_OPENAI_PORT"] == str(target["number"])


def test_inference_pool_asks_the_endpoint_picker_service():
    objects = render("inference-gateway")
    ref = find(objects, "InferencePool")["spec"]["endpointPickerRef"]
    service = find(objects, "Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    picker = find(objects, "Deployment", ref["name"])
    assert (
        service["spec"]["selector"].items()
        <= picker["spec"]["template"]["metadata"]["labels"].items()
    )


def test_http_route_sends_everything_to_the_pool():
    objects = render("inference-gateway")
    route = find(objects, "HTTPRoute")["spec"]
    (rule,) = route["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    assert backend["name"] == find(objects, "InferencePool")["metadata"]["name"]
    assert route["parentRefs"][0]["kind"] == "Gateway"


def picker_config(objects: tuple) -> dict:
    picker = find(objects, "Deployment", "slipstream-epp")["spec"]["template"]["spec"]
    args = picker["containers"][0]["args"]
    config_file = Path(args[args.index("--config-file") + 1])
    mount = picker["containers"][0]["volumeMounts"][0]
    assert str(config_file.parent) == mount["mountPath"]
    volume = next(v for v in picker["volumes"] if v["name"] == mount["name"])
    config_map = find(objects, "ConfigMap", volume["configMap"]["name"])
    return yaml.safe_load(config_map["data"][config_file.name]), args


def test_endpoint_picker_reads_slipstreams_own_metric_names():
    objects = render("inference-gateway")
    config, _ = picker_config(objects)
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")
    params = extractor["parameters"]
    (engine,) = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
    exported = {PREFIX + name for name in GAUGES}
    model = plain_env(slipstream_container(objects))["SLIPSTREAM_MODEL_NAME"]
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheNumBlocksSpec"):
        name, labels = re.fullmatch(r"(\w+)\{(.*)\}", engine[key]).groups()
        assert name in exported, (key, name)
        assert labels == f"model={model}"
    assert engine["kvUsageSpec"].startswith(PREFIX + "kv_cache_usage_ratio")
    profile_refs = {p["pluginRef"] for s in config["schedulingProfiles"] for p in s["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} <= profile_refs


def test_endpoint_picker_scrapes_metrics_at_the_pools_target_port():
    """No metrics-port override: the OpenAI API (the target port) serves Triton's /metrics."""
    config, args = picker_config(render("inference-gateway"))
    assert "--model-server-metrics-port" not in args
    source = next(p for p in config["plugins"] if p["type"] == "metrics-data-source")
    assert source["parameters"]["path"] == "/metrics"


def test_endpoint_picker_may_watch_its_pool_and_the_pods():
    objects = render("inference-gateway")
    rules = find(objects, "Role", "slipstream-epp")["rules"]
    granted = {
        (g, r)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        if {"get", "list", "watch"} <= set(rule["verbs"])
    }
    assert {("inference.networking.k8s.io", "inferencepools"), ("", "pods")} <= granted
    binding = find(objects, "RoleBinding", "slipstream-epp")
    account = find(objects, "Deployment", "slipstream-epp")["spec"]["template"]["spec"][
        "serviceAccountName"
    ]
    assert binding["subjects"][0]["name"] == account
    find(objects, "ServiceAccount", account)


# ------------------------------------------------------------------------------- the router
def router_args(objects: tuple) -> list:
    return find(objects, "Deployment", "vllm-router")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]


def test_router_discovers_the_slipstream_pods_by_label_at_their_openai_port():
    objects = render("router")
    args = router_args(objects)
    assert "--service-discovery" in args
    start = args.index("--selector") + 1
    selector = {}
    for item in args[start:]:
        if item.startswith("--"):
            break
        key, value = item.split("=")
        selector[key] = value
    assert selector and selector.items() <= pod_labels(objects, "slipstream").items()
    assert not selector.items() <= pod_labels(objects, "vllm-router").items()
    port = int(args[args.index("--service-discovery-port") + 1])
    assert port == container_port(slipstream_container(objects), "openai")
    assert args[args.index("--policy") + 1] in ("cache_aware", "round_robin", "power_of_two")


def test_router_may_list_and_watch_pods_of_its_namespace():
    objects = render("router")
    args = router_args(objects)
    assert args[args.index("--service-discovery-namespace") + 1] == "$(POD_NAMESPACE)"
    rules = find(objects, "Role", "vllm-router")["rules"]
    assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"]) for r in rules)


def test_router_listens_where_its_probes_and_service_look():
    objects = render("router")
    args = router_args(objects)
    pod = find(objects, "Deployment", "vllm-router")["spec"]["template"]["spec"]["containers"][0]
    assert int(args[args.index("--port") + 1]) == container_port(pod, "http")
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert pod["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_router_image_dockerfile_pins_the_router_and_passes_hadolint():
    text = (DEPLOY / "router" / "Dockerfile").read_text()
    version = find(render("router"), "Deployment", "vllm-router")["spec"]["template"]["spec"][
        "containers"
    ][0]["image"].split(":")[-1]
    assert f"vllm-router=={version}" in text
    hadolint = require_tool("hadolint")
    out = subprocess.run(
        [hadolint, str(DEPLOY / "router" / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
