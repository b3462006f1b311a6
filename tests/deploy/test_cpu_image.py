"""The CPU image (the Dockerfile's ``cpu`` target) built and run with podman, here, without a
registry: a Debian 12 base bootstrapped from Debian's packages (``debootstrap --variant=minbase
bookworm``) and imported, then ``podman build --target cpu`` with README's install for a
machine without a GPU. The container serves the embedded model as uid 1000 with its kernels
prebuilt, answers the manifests' probes and the OpenAI port, and stops cleanly on SIGTERM as
PID 1 within its exit timeout.

Skipped where podman or debootstrap is missing (``apt-get install podman debootstrap runc``),
without root (debootstrap needs it), and in CI unless ``SLIPSTREAM_IMAGE_TESTS=1`` (a build
takes tens of minutes on two cores): ``make image-test`` runs it; ``SLIPSTREAM_TEST_IMAGE``
names an image built already instead. The ``image`` marker
selects it (``-m image``) or leaves it out (``-m 'not image'``).
Podman runs with the runc runtime, host networking and no default ulimits (crun and setrlimit
are refused on these machines: shared/README.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from slipstream.server.launch.launcher import free_port
from deploy_support import ROOT, container, dockerfile, dockerfile_exec_form, http_path_probes

pytestmark = [pytest.mark.image, pytest.mark.server, pytest.mark.slow]

BASE = "localhost/debian-bookworm:min"
IMAGE = "localhost/slipstream:cpu-test"
BUILD_TIMEOUT_S = 3 * 3600
STARTUP_BUDGET_S = 900
EXIT_TIMEOUT_S = 20
UNLOAD_MARGIN_S = 15  # TritonServer.stop gives Triton this long beyond its exit timeout


def need_podman() -> str:
    if os.environ.get("CI") and os.environ.get("SLIPSTREAM_IMAGE_TESTS") != "1":
        pytest.skip("CI leaves the image build out (SLIPSTREAM_IMAGE_TESTS=1 runs it)")
    podman = shutil.which("podman")
    if podman is None or shutil.which("debootstrap") is None:
        pytest.skip("podman and debootstrap are not installed (apt-get install podman debootstrap)")
    if os.geteuid() != 0:
        pytest.skip("building the base with debootstrap needs root")
    return podman


def podman_env(work: Path) -> dict:
    """podman's environment: a containers.conf with no default ulimits (setrlimit is denied)."""
    conf = work / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def run(cmd: list, env: dict, log: Path, timeout: float) -> None:
    with open(log, "ab") as out:
        done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-6000:]
        raise AssertionError(f"{' '.join(cmd[:3])} ... exited {done.returncode}:\n{tail}")


def pip_setting(name: str) -> str:
    """This machine's pip setting (its environment first, then its configuration)."""
    value = os.environ.get(f"PIP_{name.upper().replace('-', '_')}")
    if value:
        return value
    found = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", f"global.{name}"],
        capture_output=True,
        text=True,
    )
    return found.stdout.strip() if found.returncode == 0 else ""


def pip_passthrough() -> list[str]:
    """podman build options handing the build this machine's pip settings: where wheels are
    found first (a CPU build of torch, where PyTorch's CPU index cannot be reached: README's
    install allows it) and the CA bundle of a TLS proxy in front of the package index."""
    options = []
    links = [p for p in pip_setting("find-links").split() if Path(p).is_dir()]
    for path in links:
        options += ["--volume", f"{path}:{path}:ro"]
    if links:
        options += ["--build-arg", f"PIP_FIND_LINKS={' '.join(links)}"]
    cert = pip_setting("cert")
    if cert and Path(cert).is_file():
        options += [
            "--volume",
            f"{cert}:/etc/pip-ca.crt:ro",
            "--build-arg",
            "PIP_CERT=/etc/pip-ca.crt",
        ]
    return options


@pytest.fixture(scope="module")
def image():
    """The image, built from this tree (or SLIPSTREAM_TEST_IMAGE, one built already)."""
    podman = need_podman()
    work = Path(tempfile.mkdtemp(prefix="slipstream-image-"))
    env, log = podman_env(work), work / "build.log"
    given = os.environ.get("SLIPSTREAM_TEST_IMAGE")
    if given:
        yield podman, env, given
        shutil.rmtree(work, ignore_errors=True)
        return
    if subprocess.run([podman, "image", "exists", BASE], env=env).returncode != 0:
        rootfs = work / "rootfs"
        run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs)], env, log, 3600)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run([podman, "import", "-", BASE], stdin=tar.stdout, env=env, check=True)
        tar.wait()
        shutil.rmtree(rootfs, ignore_errors=True)
    build = [podman, "build", "--format", "docker", "--runtime", "runc", "--network", "host"]
    build += ["--target", "cpu"]
    build += ["--build-arg", f"CPU_BASE={BASE}", "-t", IMAGE]
    build += pip_passthrough()
    started = time.monotonic()
    run([*build, str(ROOT)], env, log, BUILD_TIMEOUT_S)
    print(f"\nCPU image built in {time.monotonic() - started:.0f} s (log {log})")
    yield podman, env, IMAGE
    shutil.rmtree(work, ignore_errors=True)


class Container:
    def __init__(self, podman: str, env: dict, image: str) -> None:
        self.podman, self.env = podman, env
        self.name = f"slipstream-test-{os.getpid()}"
        self.ports = {p: free_port() for p in ("http", "grpc", "metrics", "openai")}
        settings = {f"SLIPSTREAM_{p.upper()}_PORT": str(n) for p, n in self.ports.items()}
        settings["SLIPSTREAM_EXIT_TIMEOUT"] = str(EXIT_TIMEOUT_S)
        cmd = [podman, "run", "-d", "--runtime", "runc", "--network", "host", "--shm-size", "1g"]
        cmd += ["--name", self.name]
        for key, value in settings.items():
            cmd += ["-e", f"{key}={value}"]
        subprocess.run([*cmd, image], env=env, check=True, capture_output=True, timeout=120)

    def podman_out(self, *args: str) -> str:
        done = subprocess.run(
            [self.podman, *args], env=self.env, capture_output=True, text=True, timeout=120
        )
        return done.stdout + done.stderr

    def logs(self) -> str:
        return self.podman_out("logs", self.name)

    def running(self) -> bool:
        return self.podman_out("inspect", "-f", "{{.State.Running}}", self.name).strip() == "true"

    def get(self, port: str, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[port]}{path}", timeout=5):
                return 200
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, OSError):
            return 0

    def remove(self) -> None:
        self.podman_out("rm", "-f", "-t", "0", self.name)


@pytest.fixture(scope="module")
def box(image):
    c = Container(*image)
    try:
        started = time.monotonic()
        while c.get("http", "/v2/health/ready") != 200:
            assert c.running(), f"the container exited:\n{c.logs()[-6000:]}"
            assert time.monotonic() - started < STARTUP_BUDGET_S, c.logs()[-6000:]
            time.sleep(1)
        yield c
    finally:
        c.remove()


def test_cpu_target_starts_from_its_base_argument_and_runs_the_entrypoint_as_uid_1000():
    stage = dockerfile("cpu")
    assert stage[0].args.startswith("${CPU_BASE}")
    assert [i.args for i in stage if i.keyword == "USER"][-1] == "1000:1000"
    assert dockerfile_exec_form("ENTRYPOINT", "cpu") == ["/opt/slipstream/deploy/serve.sh"]
    runs = " ".join(i.args for i in stage if i.keyword == "RUN")
    assert "make install" in runs and "slipstream build-kernels" in runs


def test_the_container_serves_the_model_as_uid_1000_with_slipstream_as_pid_1(box):
    assert box.podman_out("exec", box.name, "id", "-u").strip() == "1000"
    cmdline = box.podman_out("exec", box.name, "cat", "/proc/1/cmdline").replace("\0", " ")
    assert "slipstream serve" in cmdline, cmdline
    build = box.podman_out(
        "exec", box.name, "python", "-c", "import torch; print(torch.version.cuda)"
    )
    assert build.strip().splitlines()[-1] == "None", "torch's CPU build"


def test_the_kernels_were_built_into_the_image_not_at_start(box):
    log = box.logs()
    assert "KV allocation" in log  # the phases reach the container log
    assert "kernel build" not in log


def test_the_container_answers_the_manifests_probes(box):
    probes = http_path_probes(container("cpu"))
    assert probes, "the cpu overlay has http probes"
    for kind, (path, port) in probes.items():
        assert box.get(port, path) == 200, (kind, path, port)
    assert box.get("http", "/v2/health/live") == 200


def test_the_openai_port_answers_models_and_chat(box):
    assert box.get("openai", "/health") == 200
    base = f"http://127.0.0.1:{box.ports['openai']}/v1"
    with urllib.request.urlopen(f"{base}/models", timeout=10) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["slipstream"]
    request = urllib.request.Request(
        f"{base}/chat/completions",
        data=json.dumps(
            {
                "model": "slipstream",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16,
                "temperature": 0,
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        answer = json.loads(r.read())["choices"][0]["message"]["content"]
    assert "Paris" in answer


def test_sigterm_to_pid_1_stops_the_container_cleanly_within_the_exit_timeout(box):
    """Last: it stops the container."""
    started = time.monotonic()
    box.podman_out("kill", "--signal", "TERM", box.name)
    while box.running():
        assert time.monotonic() - started < EXIT_TIMEOUT_S + UNLOAD_MARGIN_S, box.logs()[-4000:]
        time.sleep(0.5)
    code = box.podman_out("inspect", "-f", "{{.State.ExitCode}}", box.name).strip()
    log = box.logs()
    assert code == "0", log[-4000:]
    assert "SIGTERM: stopping" in log and "Traceback" not in log
