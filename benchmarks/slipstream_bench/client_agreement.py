"""Two load generators, one server: do Slipstream's own client and vLLM's agree?

    python -m slipstream_bench.client_agreement --rate 2 --repeat 2 \
        --sampled temperature=0.8,top_p=0.95 --output-dir /tmp/agree

One ``tritonserver`` with the default repository and the OpenAI API in front of it. Each round
drives it twice with the same requests (prompts, exact output lengths, sampling) at the same
Poisson rate: once with ``slipstream bench``'s load generator (gRPC streaming to Triton's
``generate`` path) and once with vLLM's ``vllm bench serve`` (``vllm.benchmarks.serve`` from
the peers' virtualenv, ``--backend openai`` on ``/v1/completions``, the same prompts as a
``custom`` dataset, chat template skipped), alternating which goes first. Both clients draw
their own Poisson arrivals (same rate, different draws). Printed per client: tokens/s,
TTFT / TPOT / ITL percentiles, SLO attainment and goodput (requests/s meeting both targets),
each from the client's own per-request records, and the ratio of the two.

ITL differs by definition where drafts are accepted: Slipstream's client times every token,
vLLM's every streamed chunk (a chunk can carry a token and its accepted drafts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from slipstream_bench import loadgen
from slipstream_bench.goodput import Slo
from slipstream_bench.metrics import percentile, summarize
from slipstream_bench.runner import BenchOptions, cpu_info, load_tokenizer, make_workload
from slipstream_bench.step_profile import parse_sampling
from slipstream_bench.workload import SamplingMix, Workload, apply_sampling, arrival_times

VLLM_SERVE = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
    "add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


@dataclass
class ClientResult:
    """One client's run, reduced to what both clients measure."""

    client: str
    completed: int
    tokens_per_s: float
    ttft_ms: list[float]
    tpot_ms: list[float]
    itl_ms: list[float]
    duration_s: float

    def row(self, slo: Slo) -> dict:
        met = sum(
            1
            for ttft, tpot in zip(self.ttft_ms, self.tpot_ms)
            if ttft <= slo.ttft_ms and tpot <= slo.tpot_ms
        )
        out: dict = {"client": self.client, "completed": self.completed}
        out["tokens_per_s"] = self.tokens_per_s
        for name, xs in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("itl", self.itl_ms)):
            out[f"{name}_p50_ms"] = percentile(xs, 50)
            out[f"{name}_p90_ms"] = percentile(xs, 90)
        out["attainment"] = met / self.completed if self.completed else 0.0
        out["goodput_rps"] = met / self.duration_s if self.duration_s else 0.0
        return out


def _ours(grpc_url: str, workload: Workload, rate: float, seed: int) -> ClientResult:
    offsets = arrival_times(len(workload.requests), rate, seed)
    records = loadgen.run_triton(grpc_url, workload, offsets, label="slipstream-client")
    summary = summarize(records)
    ok = [r for r in records if r.error is None and r.token_times]
    return ClientResult(
        "slipstream bench (gRPC generate)",
        len(ok),
        summary["tokens_per_s"],
        [r.ttft * 1e3 for r in ok],
        [(r.tpot or 0.0) * 1e3 for r in ok],
        [x * 1e3 for r in ok for x in r.itls],
        summary["makespan_s"] or 0.0,
    )


def _dataset(workload: Workload, path: Path) -> None:
    with path.open("w") as f:
        for r in workload.requests:
            f.write(json.dumps({"prompt": r.prompt, "output_tokens": r.max_tokens}) + "\n")


def _vllm(
    python: str,
    base_url: str,
    model_dir: str,
    workload: Workload,
    rate: float,
    seed: int,
    sampling: dict,
    work: Path,
) -> ClientResult:
    data = work / "prompts.jsonl"
    _dataset(workload, data)
    result = work / f"vllm_{time.monotonic_ns()}.json"
    args = [
        python, "-c", VLLM_SERVE,
        "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", base_url,
        "--model", "slipstream", "--tokenizer", model_dir,
        "--dataset-name", "custom", "--dataset-path", str(data), "--custom-output-len", "-1",
        "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(len(workload.requests)),
        "--request-rate", str(rate), "--seed", str(seed), "--ignore-eos",
        "--save-result", "--save-detailed", "--result-dir", str(work),
        "--result-filename", result.name, "--percentile-metrics", "ttft,tpot,itl",
        "--metric-percentiles", "50,90", "--disable-tqdm",
    ]  # fmt: skip
    for key, value in sampling.items():
        if key in ("temperature", "top_p", "top_k", "min_p"):
            args += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    subprocess.run(args, check=True, env=env, stdout=sys.stderr)
    data_out = json.loads(result.read_text())
    ttfts = [t * 1e3 for t in data_out["ttfts"] if t]
    tpots = [
        sum(itl) / (n - 1) * 1e3
        for itl, n, ttft in zip(data_out["itls"], data_out["output_lens"], data_out["ttfts"])
        if ttft and n > 1
    ]
    return ClientResult(
        "vllm bench serve (OpenAI /v1/completions)",
        int(data_out["completed"]),
        float(data_out["output_throughput"]),
        ttfts,
        tpots,
        [x * 1e3 for itl in data_out["itls"] for x in itl],
        float(data_out["duration"]),
    )


def run(opts: argparse.Namespace) -> dict:
    from slipstream.server.launch.launcher import TritonServer
    from slipstream.server.openai.frontend import OpenAIFrontend
    from slipstream.worker.model.loader import resolve_model_path
    from slipstream_bench.server_run import render

    tokenizer = load_tokenizer("default")
    workload = make_workload(
        BenchOptions(num_requests=opts.num_requests, seed=opts.seed), tokenizer
    )
    sampling = parse_sampling(opts.sampled) if opts.sampled else {}
    if sampling:
        workload = apply_sampling(workload, SamplingMix(seeded=False, **sampling), opts.seed)
    slo = Slo(opts.ttft_ms, opts.tpot_ms)
    rounds: list = []
    with tempfile.TemporaryDirectory(prefix="slipstream-agree-") as tmp:
        work = Path(tmp)
        repo = render(dict(s.split("=", 1) for s in opts.set), work / "repo")
        server = TritonServer(
            repo, http_port=0, grpc_port=0, metrics_port=0, log_path=work / "tritonserver.log"
        )
        with server:
            with OpenAIFrontend.for_repository(repo, server.grpc_url) as api:
                loadgen.warm_up(
                    server.grpc_url, make_workload(BenchOptions(num_requests=2, seed=99), tokenizer)
                )
                for r in range(opts.repeat):
                    seed = opts.seed + r
                    ours = lambda: _ours(server.grpc_url, workload, opts.rate, seed)  # noqa: E731
                    theirs = lambda: _vllm(  # noqa: E731
                        opts.peer_python, api.url, str(resolve_model_path("default")),
                        workload, opts.rate, seed, sampling, work,
                    )  # fmt: skip
                    order = (ours, theirs) if r % 2 == 0 else (theirs, ours)
                    results = [f() for f in order]
                    rows = sorted((x.row(slo) for x in results), key=lambda x: x["client"])
                    rounds.append(rows)
                    print(json.dumps({"round": r, "rows": rows}), flush=True)
    return {"machine": cpu_info(), "rate": opts.rate, "sampling": sampling,
            "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}, "rounds": rounds,
            "median": _medians(rounds)}  # fmt: skip


def _medians(rounds: list) -> list:
    out = []
    for i, first in enumerate(rounds[0]):
        row: dict = {"client": first["client"]}
        for key, value in first.items():
            if isinstance(value, (int, float)):
                values = [r[i][key] for r in rounds if r[i][key] is not None]
                row[key] = statistics.median(values) if values else None
        out.append(row)
    return out


def table(result: dict) -> str:
    rows = result["median"]
    cols = ["tokens_per_s", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms",
            "itl_p50_ms", "itl_p90_ms", "attainment", "goodput_rps"]  # fmt: skip
    lines = ["| client | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for row in rows + [_ratio(rows)]:
        lines.append(f"| {row['client']} | " + " | ".join(_fmt(row.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def _ratio(rows: list) -> dict:
    a, b = rows  # sorted: slipstream first, vllm second
    out: dict = {"client": "slipstream / vllm"}
    for key, value in a.items():
        if isinstance(value, (int, float)) and isinstance(b.get(key), (int, float)) and b[key]:
            out[key] = value / b[key]
    return out


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=2.0, help="Poisson requests/s")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--sampled", default="", help="e.g. temperature=0.8,top_p=0.95 (else greedy)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--ttft-ms", type=float, default=2000.0)
    p.add_argument("--tpot-ms", type=float, default=150.0)
    p.add_argument(
        "--peer-python",
        default=str(Path.home() / ".cache/slipstream/peers/venv/bin/python"),
        help="the virtualenv with vLLM (scripts/setup_peers.py)",
    )
    p.add_argument("--output-dir", type=Path, default=Path("benchmarks/results/agreement"))
    opts = p.parse_args(argv)
    result = run(opts)
    opts.output_dir.mkdir(parents=True, exist_ok=True)
    (opts.output_dir / "agreement.json").write_text(json.dumps(result, indent=1))
    print(result["machine"])
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
