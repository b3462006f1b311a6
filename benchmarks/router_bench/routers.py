"""The routers under test, each a process on 127.0.0.1 in front of the replicas' OpenAI ports:
vllm-router (``round_robin``, ``cache_aware``, ``kv_aware`` fed by the replicas' KV events)
and sglang-router (``cache_aware``, OpenAI backend), installed by scripts/setup_routers.sh;
``direct`` is no router (one replica)."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from router_bench.replicas import BLOCK_SIZE, Replica

# A replica busy on its one core can take seconds to answer /health: with the routers'
# default timeouts (sglang-router: 5 s) it is marked unhealthy and its share of the traffic
# lands on the other replica, which then measures the health checker, not the policy.
HEALTH_CHECK = ("--health-check-timeout-secs", "60", "--health-failure-threshold", "10")


@dataclass(frozen=True)
class RouterSpec:
    name: str  # the table's label
    router: str  # "vllm-router", "sglang-router" or "direct"
    policy: str = ""
    replicas: Optional[int] = None  # None: the run's replica count
    log_level: str = "warning"

    def command(
        self, routers_dir: Path, port: int, replicas: list[Replica], tokenizer_dir: str
    ) -> list[str]:
        urls = [r.url for r in replicas]
        if self.router == "vllm-router":
            cmd = [
                str(routers_dir / "vllm-router" / "bin" / "vllm-router"),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--policy",
                self.policy,
                "--worker-urls",
                *urls,
                "--log-level",
                self.log_level,
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(port + 1),
                *HEALTH_CHECK,
            ]
            if self.policy == "kv_aware":
                for r in replicas:
                    cmd += ["--kv-event-source", f"{r.url}={r.kv_endpoint}"]
                cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", tokenizer_dir]
            return cmd
        if self.router == "sglang-router":
            return [
                str(routers_dir / "sglang-router" / "bin" / "python"),
                "-m",
                "sglang_router.launch_router",
                "--backend",
                "openai",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--policy",
                self.policy,
                "--worker-urls",
                *urls,
                "--log-level",
                "warn",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(port + 1),
                *HEALTH_CHECK,
            ]
        raise ValueError(f"no command for {self.router}")


SPECS = {
    "single": RouterSpec("one replica (whole workload)", "direct", replicas=1),
    "vllm-rr": RouterSpec("vllm-router round_robin", "vllm-router", "round_robin"),
    "vllm-cache": RouterSpec("vllm-router cache_aware", "vllm-router", "cache_aware"),
    "vllm-kv": RouterSpec("vllm-router kv_aware", "vllm-router", "kv_aware"),
    "sglang-cache": RouterSpec("sglang-router cache_aware", "sglang-router", "cache_aware"),
}


def start_router(
    spec: RouterSpec,
    routers_dir: Path,
    port: int,
    replicas: list[Replica],
    tokenizer_dir: str,
    log_path: Path,
    timeout_s: float = 120.0,
) -> subprocess.Popen:
    log = open(log_path, "w")
    process = subprocess.Popen(
        spec.command(routers_dir, port, replicas, tokenizer_dir),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{spec.name} exited: see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return process
        except OSError:
            pass
        time.sleep(0.5)
    process.kill()
    raise TimeoutError(f"{spec.name} not ready: see {log_path}")


def stop_router(process: Optional[subprocess.Popen]) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
