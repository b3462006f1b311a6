"""The shared-prefix workload through vLLM's own benchmark client (``vllm bench serve``, from
the peers' virtualenv): ``--dataset-name prefix_repetition`` draws ``num_prefixes`` random
token prefixes of ``prefix_len`` tokens, each followed by ``num_prompts / num_prefixes``
random suffixes of ``suffix_len`` tokens, shuffled, sent as chat messages at a Poisson
``request_rate`` to the router, each answered with exactly ``output_len`` tokens (EOS ignored,
greedy). Every run of one spec sends the same prompts at the same arrival times (``seed``)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from router_bench.client import TurnRecord
from router_bench.engines import MODEL_NAME
from slipstream_bench.client_agreement import VLLM_SERVE


@dataclass
class PrefixSpec:
    prefix_len: int = 1500
    suffix_len: int = 256  # vLLM's default
    num_prefixes: int = 24
    num_prompts: int = 96
    request_rate: float = 0.7
    output_len: int = 128  # vLLM's default
    seed: int = 0

    def describe(self) -> str:
        return (
            f"vLLM's benchmark client, prefix_repetition: {self.num_prefixes} prefixes x "
            f"{self.prefix_len} tokens, {self.num_prompts} requests ({self.suffix_len}-token "
            f"suffixes, {self.output_len}-token answers) at {self.request_rate} req/s"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def command(python: str, base_url: str, tokenizer_dir: str, spec: PrefixSpec, result: Path) -> list:
    """``python``: the vLLM virtualenv's interpreter; ``base_url``: the router."""
    return [
        python, "-c", VLLM_SERVE,
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", base_url, "--model", MODEL_NAME, "--tokenizer", tokenizer_dir,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(spec.prefix_len),
        "--prefix-repetition-suffix-len", str(spec.suffix_len),
        "--prefix-repetition-num-prefixes", str(spec.num_prefixes),
        "--prefix-repetition-output-len", str(spec.output_len),
        "--num-prompts", str(spec.num_prompts), "--request-rate", str(spec.request_rate),
        "--seed", str(spec.seed), "--ignore-eos", "--temperature", "0",
        # the harness has waited for every replica; the client's own ready check would send
        # one of the workload's prompts first, warming one replica's cache with it
        "--ready-check-timeout-sec", "0",
        "--save-result", "--save-detailed", "--result-dir", str(result.parent),
        "--result-filename", result.name,
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90",
        "--disable-tqdm",
    ]  # fmt: skip


def records(result: dict) -> list[TurnRecord]:
    """One record per request of a saved (``--save-detailed``) run, in the client's order."""
    starts = result.get("start_times") or [0.0] * len(result["ttfts"])
    first = min(starts) if starts else 0.0
    out = []
    for i, (ttft, latency, n, error, start) in enumerate(
        zip(result["ttfts"], result["latencies"], result["output_lens"], result["errors"], starts)
    ):
        ok = not error and ttft
        out.append(
            TurnRecord(
                f"r{i}",
                -1,
                0,
                start - first,
                ttft if ok else None,
                latency if ok else None,
                int(n or 0),
                None if ok else (error or "no output")[:300],
            )
        )
    return out


def run(
    python: str,
    base_url: str,
    tokenizer_dir: str,
    spec: PrefixSpec,
    result: Path,
    timeout_s: float,
    log_path: Path,
) -> tuple[list[TurnRecord], float]:
    """(records, the client's benchmark duration in seconds)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the peer's own packages
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    with open(log_path, "w") as log:
        subprocess.run(
            command(python, base_url, tokenizer_dir, spec, result),
            check=True,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
        )
    data = json.loads(result.read_text())
    return records(data), float(data["duration"])
