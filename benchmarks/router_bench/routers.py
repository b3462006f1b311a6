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

from router_bench.replicas import Replica

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
        self,
        routers_dir: Path,
        port: int,
        replicas: list[Replica],
        tokenizer_dir: str,
        block_size: int,
        log_level: Optional[str] = None,
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
                log_level or self.log_level,
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(port + 1),
                *HEALTH_CHECK,
            ]
            if self.policy == "kv_aware":
                for r in replicas:
                    cmd += ["--kv-event-source", f"{r.url}={r.kv_endpoint}"]
                cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", tokenizer_dir]
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
    block_size: int,
    log_path: Path,
    log_level: Optional[str] = None,
    timeout_s: float = 120.0,
) -> subprocess.Popen:
    log = open(log_path, "w")
    process = subprocess.Popen(
        spec.command(routers_dir, port, replicas, tokenizer_dir, block_size, log_level),
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


def kv_decisions(port: int) -> dict:
    """vllm-router's own account of its ``kv_aware`` decisions (its Prometheus port, ``port``):
    how many were scored by prefix cost and how many had no token ids (``missing_tokens``: the
    worker's render API failed) or fell back otherwise, and its KV index lookups (hit/miss)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    wanted = {
        "vllm_router_prefix_routing_decisions": "outcome",
        "vllm_router_kv_placement_lookups": "result",
    }
    out: dict = {}
    for family in text_string_to_metric_families(text):
        label = wanted.get(family.name)
        if label is None:
            continue
        counts = out.setdefault(family.name.removeprefix("vllm_router_"), {})
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = sample.labels.get(label, "?")
                counts[key] = counts.get(key, 0) + int(sample.value)
    return out
