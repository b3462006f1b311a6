"""``slipstream bench``: the arguments, and which scenario they run."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from slipstream.server.launch.cli import parse_sets

HELP = (
    "benchmark: a workload over Triton gRPC streaming in static/dynamic/continuous "
    "modes, the in-process engine, Hugging Face baselines, vLLM peers, the roofline; "
    "JSON + PNG"
)


def _modes(text: str) -> tuple:
    from slipstream_bench.runner import ALL_MODES

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; choose from {ALL_MODES}")
    return modes


def _variants(items) -> dict:
    """``NAME:KEY=VALUE,KEY=VALUE`` -> {NAME: {KEY: VALUE}}; an empty list is allowed."""
    out: dict = {}
    for item in items or []:
        name, _, rest = item.partition(":")
        if not name.strip() or any(c in name for c in "[], "):
            raise SystemExit(f"--variant expects NAME:KEY=VALUE,..., got {item!r}")
        out[name.strip()] = parse_sets([kv for kv in rest.split(",") if kv.strip()])
    return out


def _rates(text: str) -> tuple:
    if text.strip().startswith("auto"):  # auto[:START[:STEP]]
        parts = text.strip().split(":")[1:]
        try:
            start, step = (
                (float(parts[0]) if parts else 1.0),
                (float(parts[1]) if len(parts) > 1 else 1.0),
            )
        except ValueError:
            raise argparse.ArgumentTypeError(f"--rates auto[:START[:STEP]], got {text!r}")
        if start <= 0 or step <= 0:
            raise argparse.ArgumentTypeError("--rates auto: START and STEP must be positive")
        return ("auto", start, step)
    try:
        rates = tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates expects numbers, e.g. 0.5,1,1.5; got {text!r}")
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("--rates must be positive (requests/s) or inf")
    return rates


def _auto(rates: tuple) -> bool:
    return bool(rates) and rates[0] == "auto"


def add_args(p: argparse.ArgumentParser) -> None:
    from slipstream_bench.runner import ALL_MODES, DEFAULT_MODES

    p.add_argument(
        "--scenario",
        choices=("batching", "prefix-cache", "quality"),
        default="batching",
        help="batching: every mode on one workload; prefix-cache: a shared long "
        "system prompt with prefix caching on and off; quality: reduced-"
        "precision weights against fp32 (perplexity, KL, greedy agreement)",
    )
    p.add_argument(
        "--quality-weights",
        default="bfloat16,int8,gguf",
        help="quality scenario: comma list of weight formats to gate (bfloat16, int8, "
        "gguf: the embedded model's own Q4_1 blocks as they ship; default all three)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        help="requests to generate (default 64; prefix-cache 32; --quick 6)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument(
        "--workload",
        metavar="FILE",
        help="a workload JSON file (as written to "
        "OUTPUT_DIR/workload.json) instead of a generated one",
    )
    p.add_argument("--prompt-lens", help="prompt length distribution, e.g. 'uniform:16:256'")
    p.add_argument(
        "--output-lens",
        help="output length distribution, e.g. '0.875*uniform:16:64+0.125*uniform:256:512'",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=math.inf,
        help="Poisson arrival rate in requests/s (default inf: all at once)",
    )
    p.add_argument(
        "--rates",
        type=_rates,
        default=(),
        help="a sweep: comma list of Poisson rates (requests/s; 'inf' = a burst), "
        "every mode at each; prints SLO attainment per rate and goodput. 'auto[:START[:STEP]]' "
        "(default 1:1): from START up by STEP until every mode falls below the SLO attainment "
        "(a mode that fell below stops running)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=0,
        help="at most this many requests in flight (a closed loop; 1: one request at a time, "
        "as a single user sends them); default 0: each request at its arrival time",
    )
    s = p.add_argument_group("decoding (greedy unless --temperature > 0)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument(
        "--seeded", action="store_true", help="each sampled request gets a seed of its own"
    )
    s.add_argument(
        "--greedy-fraction",
        type=float,
        default=0.0,
        help="this share of the requests decodes greedily (a greedy/sampled mix)",
    )
    p.add_argument(
        "--prefix-caching",
        choices=("default", "on", "off"),
        default="default",
        help="every engine's prefix caching: as each ships it (default: on for "
        "Slipstream and vLLM), or forced on/off",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT target (default 2000)")
    p.add_argument("--slo-tpot-ms", type=float, default=150.0, help="TPOT target (default 150)")
    p.add_argument(
        "--slo-attainment",
        type=float,
        default=0.9,
        help="share of requests that must meet both for a rate to count toward "
        "goodput (DistServe; default 0.9)",
    )
    p.add_argument(
        "--modes",
        type=_modes,
        default=DEFAULT_MODES,
        help=f"comma list, subset of {','.join(ALL_MODES)} (default all but vllm_offline_eager)",
    )
    p.add_argument(
        "--output-dir",
        type=Path,
        default=Path("benchmarks/results"),
        help="where results.json, workload.json, traces and PNGs go",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny smoke run: few requests, short outputs"
    )
    p.add_argument(
        "--model",
        default="default",
        help="'default' (embedded SmolLM2-135M-Instruct) or a HF model directory",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="static/dynamic batch size, and HF generate's batch (default 8)",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=1024**3,
        help="engine KV cache pool (default 1 GiB: the workload fits at once)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="extra engine setting for every engine run, repeatable",
    )
    p.add_argument(
        "--variant",
        action="append",
        metavar="NAME:KEY=VALUE,...",
        default=[],
        help="an extra in-process run, labelled inprocess[NAME], with these engine "
        "settings on top of the continuous server's (repeatable): measures "
        "changes side by side, e.g. 'mkl:cpu_linear=transposed'",
    )
    p.add_argument(
        "--variant-modes",
        default="inprocess",
        help="comma list of the modes variants run as: inprocess or continuous "
        "(every variant; continuous[NAME] is the server with its settings), "
        "or MODE:NAME (that variant only); default inprocess",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of every mode, alternating their order; each mode's median "
        "round is reported (default 1; use 3+ on a noisy machine)",
    )
    p.add_argument(
        "--peers-dir",
        type=Path,
        default=None,
        help="where scripts/setup_peers.py installed the vLLM peer (default "
        "~/.cache/slipstream/peers); its modes are skipped when absent",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def options(args: argparse.Namespace):
    from slipstream_bench.goodput import Slo
    from slipstream_bench.runner import BenchOptions
    from slipstream_bench.workload import SamplingMix

    default_n = 6 if args.quick else (32 if args.scenario == "prefix-cache" else 64)
    return BenchOptions(
        model=args.model,
        num_requests=args.num_requests or default_n,
        seed=args.seed,
        workload_file=args.workload,
        rate=args.rate,
        modes=args.modes,
        output_dir=args.output_dir,
        quick=args.quick,
        progress=not args.no_progress,
        prompt_lens=args.prompt_lens,
        output_lens=args.output_lens,
        static_batch_size=args.batch_size,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        settings=parse_sets(args.set),
        repeat=max(args.repeat, 1),
        peers_dir=args.peers_dir,
        variants=_variants(args.variant),
        variant_modes=tuple(
            m.strip()
            for m in args.variant_modes.split(",")
            if m.strip().partition(":")[0] in ("inprocess", "continuous")
        ),
        rates=args.rates[1:2] if _auto(args.rates) else args.rates,
        sweep_until_all_fail=_auto(args.rates),
        sweep_step=args.rates[2] if _auto(args.rates) else 1.0,
        max_in_flight=args.max_concurrency,
        sampling=SamplingMix(
            args.temperature,
            args.top_p,
            args.top_k,
            args.min_p,
            args.repetition_penalty,
            args.presence_penalty,
            args.frequency_penalty,
            args.seeded,
            args.greedy_fraction,
        ),
        prefix_caching={"default": None, "on": True, "off": False}[args.prefix_caching],
        slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_attainment),
    )


def run(args: argparse.Namespace) -> int:
    if args.scenario == "quality":
        from slipstream_bench.quality import run_quality

        weights = [w.strip() for w in args.quality_weights.split(",") if w.strip()]
        return run_quality(args.model, weights, args.output_dir)
    opts = options(args)
    if args.scenario == "prefix-cache":
        from slipstream_bench.prefix import run_prefix_cache

        run_prefix_cache(opts)
    else:
        from slipstream_bench.runner import run_batching

        run_batching(opts)
    return 0
