"""Every kustomization under deploy/ renders objects the API server would accept as far as names
go: a name that must be unique in its list (a container's ports and environment variables, a
pod's containers and volumes, a Service's ports) appears once. The schema check does not see a
repeated list entry, while `kubectl apply` refuses it (a Service with two ports named `openai`)
or keeps one of the two silently (an env var set twice)."""

from __future__ import annotations

from collections import Counter

import pytest
import yaml

from deploy_support import DEPLOY, render

POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def kustomizations() -> list[str]:
    """Every directory under deploy/ with a kustomization that can be applied (not a Component)."""
    found = []
    for path in sorted(DEPLOY.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind", "Kustomization") == "Kustomization":
            found.append(str(path.parent.relative_to(DEPLOY)))
    return found


def repeated(values) -> list:
    return sorted(str(v) for v, n in Counter(values).items() if n > 1)


def pod_spec_of(obj: dict) -> dict | None:
    if obj["kind"] == "Pod":
        return obj["spec"]
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    if obj["kind"] in POD_TEMPLATE_KINDS:
        return obj["spec"]["template"]["spec"]
    return None


def name_clashes(obj: dict) -> list[str]:
    """What is named twice in one object, as 'where: names' lines (empty: nothing)."""
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    found = []

    def check(what: str, values) -> None:
        twice = repeated(values)
        if twice:
            found.append(f"{where} {what}: {', '.join(twice)}")

    if obj["kind"] == "Service":
        ports = obj["spec"].get("ports", [])
        check("port names", [p.get("name", "") for p in ports])
        check("ports", [(p["port"], p.get("protocol", "TCP")) for p in ports])
    pod = pod_spec_of(obj)
    if pod is None:
        return found
    containers = pod.get("containers", []) + pod.get("initContainers", [])
    check("container names", [c["name"] for c in containers])
    check("volume names", [v["name"] for v in pod.get("volumes", [])])
    for c in containers:
        ports = c.get("ports", [])
        check(f"container {c['name']} port names", [p["name"] for p in ports if "name" in p])
        check(
            f"container {c['name']} ports",
            [(p["containerPort"], p.get("protocol", "TCP")) for p in ports],
        )
        check(f"container {c['name']} env names", [e["name"] for e in c.get("env", [])])
        check(
            f"container {c['name']} mount paths",
            [m["mountPath"] for m in c.get("volumeMounts", [])],
        )
    return found


def test_every_applicable_kustomization_is_checked():
    """The list is found, not written down: a new overlay is checked without editing this file."""
    found = kustomizations()
    for expected in ("base", "overlays/cpu", "overlays/gpu", "inference-gateway", "router"):
        assert expected in found


@pytest.mark.parametrize("kustomization", kustomizations())
def test_rendered_objects_name_each_port_env_var_and_volume_once(kustomization):
    objects = render(kustomization)
    clashes = [line for obj in objects for line in name_clashes(obj)]
    assert clashes == [], f"deploy/{kustomization}: " + "; ".join(clashes)


def test_name_check_finds_a_port_declared_twice():
    """The check itself: a Service and a container with the `openai` port added twice (what a
    component patching the base did) are both reported."""
    service = {
        "kind": "Service",
        "metadata": {"name": "s"},
        "spec": {
            "ports": [
                {"name": "openai", "port": 9000},
                {"name": "openai", "port": 9000},
            ]
        },
    }
    deployment = {
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "ports": [{"name": "openai", "containerPort": 9000}] * 2,
                            "env": [{"name": "PORT", "value": "1"}, {"name": "PORT", "value": "2"}],
                        }
                    ]
                }
            }
        },
    }
    assert name_clashes(service) == [
        "Service/s port names: openai",
        "Service/s ports: (9000, 'TCP')",
    ]
    assert name_clashes(deployment) == [
        "Deployment/d container c port names: openai",
        "Deployment/d container c ports: (9000, 'TCP')",
        "Deployment/d container c env names: PORT",
    ]
