"""Tensor parallelism on one machine, side by side: the same workload on one rank with all the
cores' threads (``tp1``) and on ranks of one core's share each (``tp2``: two processes, gloo
between them), in process (``EngineLoop``, the shipped repository's settings).

Two workloads, as ``slipstream bench`` makes them: ``burst`` (64 requests at once, greedy) and
``poisson`` (arrivals at ``--rate`` requests/s, sampled chat traffic: temperature 0.8, top-p
0.95, a seed each). Per run: output tokens/s, TTFT, inter-token latency (p50 / p90), and rank
0's time inside collectives per engine step (the all-reduces after attention and the MLP, the
embedding's, the logits' gather: the wire's time and the wait for the slower rank).

    python -m slipstream_bench.tp_scaling                       # both workloads, tp1 and tp2
    python -m slipstream_bench.tp_scaling --repeat 3 --output-dir benchmarks/results/tp
    python -m slipstream_bench.tp_scaling --quick               # smoke: a few short requests

Timings are only comparable within one run on a quiet machine (the configurations alternate,
round after round).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from slipstream_bench import server_run
from slipstream_bench.inprocess import make_loop, run_requests, stats_delta
from slipstream_bench.metrics import summarize
from slipstream_bench.runner import (
    QUICK_OUTPUT_LENS,
    QUICK_PROMPT_LENS,
    load_tokenizer,
    machine,
    warmup_workload,
)
from slipstream_bench.workload import (
    DEFAULT_OUTPUT_LENS,
    DEFAULT_PROMPT_LENS,
    SamplingMix,
    Workload,
    apply_sampling,
    arrival_times,
    generate_workload,
)

CONFIGS = {"tp1": 1, "tp2": 2}  # name -> tensor_parallel_size
WORKLOADS = ("burst", "poisson")
CHAT = SamplingMix(temperature=0.8, top_p=0.95, seeded=True)


@dataclass(frozen=True)
class Plan:
    """One measured run: a configuration on a workload."""

    config: str
    workload: str
    round: int


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m slipstream_bench.tp_scaling",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--model", default="default", help="'default' or a model directory")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="burst, poisson")
    p.add_argument("--configs", default=",".join(CONFIGS), help="tp1, tp2")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=1.5, help="poisson arrivals, requests/s")
    p.add_argument("--repeat", type=int, default=1, help="rounds; medians are reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="per rank")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another engine setting for every configuration",
    )
    p.add_argument("--output-dir", default="benchmarks/results/tp_scaling")
    p.add_argument("--quick", action="store_true", help="smoke run: 6 short requests")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def workloads(args: argparse.Namespace, tokenizer) -> dict:
    """name -> (workload, send offsets, warm-up workload)."""
    prompt, output = DEFAULT_PROMPT_LENS, DEFAULT_OUTPUT_LENS
    if args.quick:
        prompt, output = QUICK_PROMPT_LENS, QUICK_OUTPUT_LENS
    n = 6 if args.quick else args.num_requests
    warm = warmup_workload(tokenizer, args.seed)
    out = {}
    for name in args.workloads.split(","):
        wl = generate_workload(tokenizer, n, args.seed, prompt, output)
        rate = math.inf
        if name == "poisson":
            apply_sampling(wl, CHAT, args.seed)
            rate = args.rate
        elif name != "burst":
            raise SystemExit(f"unknown workload {name!r}; choose from {WORKLOADS}")
        out[name] = (wl, arrival_times(n, rate, args.seed), warm)
    return out


def engine_settings(args: argparse.Namespace, tensor_parallel_size: int) -> dict:
    from slipstream.server.launch.cli import parse_sets

    overrides = {
        "model": args.model,
        "kv_cache_memory_bytes": args.kv_cache_bytes,
        **parse_sets(args.set),
        "tensor_parallel_size": tensor_parallel_size,
    }
    return server_run.rendered_settings(overrides)


def measure(settings: dict, wl: Workload, offsets: list, warm: Workload, progress: bool) -> dict:
    """One run on a fresh engine: the workload's summary, the engine's counters, and rank
    0's collective time per step."""
    wake = threading.Event()
    threads = torch.get_num_threads()
    loop = make_loop(settings, on_output=wake.set)
    try:
        run_requests(loop, wake, warm, [0.0] * len(warm), progress=False)
        leader = loop.engine.parallel
        clock_before = (leader.clock.seconds, leader.clock.calls) if leader else (0.0, 0)
        stats_before = loop.stats()
        records = run_requests(loop, wake, wl, offsets, label="measured", progress=progress)
        clock_after = (leader.clock.seconds, leader.clock.calls) if leader else (0.0, 0)
        stats_after = loop.engine.get_stats()
        engine_threads = torch.get_num_threads()
    finally:
        loop.shutdown()
        torch.set_num_threads(threads)
    engine = stats_delta(stats_before, stats_after)
    steps = max(engine["steps"], 1)
    return {
        "summary": summarize(records),
        "engine": engine,
        "rank0_threads": engine_threads,
        "collective_ms_per_step": 1000 * (clock_after[0] - clock_before[0]) / steps,
        "collectives_per_step": (clock_after[1] - clock_before[1]) / steps,
    }


def headline(run: dict) -> dict:
    s = run["summary"]
    return {
        "tokens_per_s": s.get("tokens_per_s", 0.0),
        "ttft_p50_ms": (s.get("ttft_ms") or {}).get("p50"),
        "itl_p50_ms": (s.get("itl_ms") or {}).get("p50"),
        "itl_p90_ms": (s.get("itl_ms") or {}).get("p90"),
        "step_ms": 1000 * run["engine"]["busy_seconds"] / max(run["engine"]["steps"], 1),
        "collective_ms_per_step": run["collective_ms_per_step"],
        "collectives_per_step": run["collectives_per_step"],
        "errors": s.get("num_errors", 0),
    }


def medians(runs: list) -> dict:
    rows = [headline(r) for r in runs]
    out: dict = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        out[key] = None if None in values else statistics.median(values)
    return out


COLUMNS = (  # (heading, key, decimals)
    ("tok/s", "tokens_per_s", 1),
    ("TTFT p50", "ttft_p50_ms", 1),
    ("ITL p50", "itl_p50_ms", 1),
    ("ITL p90", "itl_p90_ms", 1),
    ("step ms", "step_ms", 1),
    ("coll ms/step", "collective_ms_per_step", 2),
    ("coll/step", "collectives_per_step", 1),
)


def table(results: dict) -> str:
    lines = [f"{'workload':<9} {'config':<6} " + " ".join(f"{h:>12}" for h, _, _ in COLUMNS)]
    for name, configs in results.items():
        for config, row in configs.items():
            cells = [
                f"{row[key]:>12.{digits}f}" if row[key] is not None else f"{'-':>12}"
                for _, key, digits in COLUMNS
            ]
            lines.append(f"{name:<9} {config:<6} " + " ".join(cells))
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    loads = workloads(args, tokenizer)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    settings = {c: engine_settings(args, CONFIGS[c]) for c in configs}
    runs: dict = {name: {c: [] for c in configs} for name in loads}
    for round_index in range(args.repeat):
        for name, (wl, offsets, warm) in loads.items():
            for config in configs:  # alternating: a drift of the machine hits both alike
                print(f"== {name} {config} round {round_index + 1}/{args.repeat}", flush=True)
                runs[name][config].append(
                    measure(settings[config], wl, offsets, warm, not args.no_progress)
                )
    results = {name: {c: medians(r) for c, r in by_c.items()} for name, by_c in runs.items()}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": machine(),
        "cores": sorted(os.sched_getaffinity(0)),
        "settings": settings,
        "rate": args.rate,
        "medians": results,
        "runs": runs,
    }
    (out / "tp_scaling.json").write_text(json.dumps(report, indent=1, default=str))
    print(table(results))
    print(f"results: {out / 'tp_scaling.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
