"""deploy/leaderworkerset without a cluster: tensor parallelism across machines as a
LeaderWorkerSet. It renders; the built-in objects validate against the Kubernetes schema, the
LeaderWorkerSet against its CRD's (tests/deploy/data/crds, strict) and its pod templates against the
Kubernetes schema; a failed pod restarts its whole group; the leader serves as the base's
Deployment does; the command each pod runs (`slipstream serve` with LeaderWorkerSet's
environment) makes the leader rank 0 of a group over the pods and the workers headless."""

import copy

import pytest

from slipstream import EngineConfig
from slipstream.server.launch.cli import build_parser, serve_overrides
from deploy_support import ROOT, find, render, require_module, served_crd_schema

LWS = "leaderworkerset"
CRD = ROOT / "tests" / "deploy" / "data" / "crds" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"


def group() -> dict:
    return find(render(LWS), "LeaderWorkerSet", "slipstream")


def template(role: str) -> dict:
    return group()["spec"]["leaderWorkerTemplate"][f"{role}Template"]


def slipstream(role: str) -> dict:
    return next(c for c in template(role)["spec"]["containers"] if c["name"] == "slipstream")


def validate_group(obj: dict) -> None:
    jsonschema = require_module("jsonschema")
    jsonschema.validate(obj, served_crd_schema(CRD, obj["apiVersion"]))


@pytest.mark.parametrize("version", ["1.29.0", None])
def test_builtin_objects_and_pod_templates_validate_against_the_kubernetes_schema(version):
    kubernetes_validate = require_module("kubernetes_validate")
    version = version or kubernetes_validate.latest_version()
    objects = render(LWS)
    builtin = [o for o in objects if o["kind"] in ("Service", "HorizontalPodAutoscaler")]
    assert len(builtin) == 2
    for obj in builtin:
        kubernetes_validate.validate(obj, version, strict=True)
    for role in ("leader", "worker"):
        pod = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"slipstream-{role}"},
            "template": template(role),
        }
        kubernetes_validate.validate(pod, version, strict=True)


def test_the_group_validates_against_the_leaderworkerset_crd():
    validate_group(group())
    broken = copy.deepcopy(group())
    broken["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RestartEverythingSometimes"
    with pytest.raises(require_module("jsonschema").ValidationError):
        validate_group(broken)
    broken = copy.deepcopy(group())
    broken["spec"]["leaderWorkerTemplate"]["sizes"] = 2  # a misspelled field
    with pytest.raises(require_module("jsonschema").ValidationError):
        validate_group(broken)


def test_a_failed_pod_restarts_its_whole_group_and_workers_start_with_their_leader():
    spec = group()["spec"]
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    # LeaderReady would wait for a leader that is ready only once its workers have joined
    assert spec["startupPolicy"] == "LeaderCreated"
    assert not [o for o in render(LWS) if o["kind"] == "Deployment"]  # the group replaces it


def test_the_leader_serves_as_the_base_deployment_does():
    base = next(
        c
        for c in find(render("base"), "Deployment")["spec"]["template"]["spec"]["containers"]
        if c["name"] == "slipstream"
    )
    leader = slipstream("leader")
    for field in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        assert leader[field] == base[field], field
    assert leader["ports"][: len(base["ports"])] == base["ports"]
    assert {e["name"] for e in base["env"]} <= {e["name"] for e in leader["env"]}
    assert leader["image"] == base["image"] == slipstream("worker")["image"]


def test_requests_reach_the_leaders_and_the_autoscaler_counts_groups():
    objects = render(LWS)
    selector = find(objects, "Service", "slipstream")["spec"]["selector"]
    assert selector.items() <= template("leader")["metadata"]["labels"].items()
    assert not selector.items() <= template("worker")["metadata"]["labels"].items()
    target = find(objects, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("LeaderWorkerSet", "slipstream")


def _serve(role: str, index: int, monkeypatch):
    """`slipstream serve`'s arguments in a pod of the group (LeaderWorkerSet's environment)."""
    size = group()["spec"]["leaderWorkerTemplate"]["size"]
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "slipstream-0.slipstream.llm")
    monkeypatch.setenv("LWS_GROUP_SIZE", str(size))
    monkeypatch.setenv("LWS_WORKER_INDEX", str(index))
    return build_parser().parse_args(["serve", *slipstream(role).get("args", [])])


def test_the_leaders_command_makes_it_rank_0_of_a_group_over_the_pods(monkeypatch):
    args = _serve("leader", 0, monkeypatch)
    assert args.node_rank == 0  # serves
    config = EngineConfig.from_dict(serve_overrides(args))
    size = group()["spec"]["leaderWorkerTemplate"]["size"]
    assert config.nnodes == size and config.tensor_parallel_size % size == 0
    assert config.master_addr == "slipstream-0.slipstream.llm"
    ports = {p["name"]: p["containerPort"] for p in slipstream("leader")["ports"]}
    assert config.master_port == ports["rendezvous"]


def test_a_workers_command_runs_its_ranks_headless_against_the_leader(monkeypatch):
    args = _serve("worker", 1, monkeypatch)
    leader = _serve("leader", 0, monkeypatch)
    assert args.node_rank == 1 and args.nnodes == leader.nnodes
    assert (args.master_addr, args.master_port) == (leader.master_addr, leader.master_port)
