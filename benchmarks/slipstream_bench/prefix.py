"""The prefix-cache scenario: many requests behind one long shared system prompt, run with
``enable_prefix_caching`` on and off, on the in-process engine and through the server.

Reported per run: the prefix-cache hit rate (prompt tokens served from cache / prompt
tokens looked up), TTFT and tokens/s. The server exposes the hit rate only as a running
gauge, which also counts the warm-up requests' lookups (never hits: their words differ), so
it is rescaled to the measured requests' lookups.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from slipstream_bench import server_run
from slipstream_bench.runner import (
    BenchOptions,
    finish,
    load_tokenizer,
    log,
    machine,
    server_overrides,
    warmup_workload,
)
from slipstream_bench.workload import (
    Workload,
    arrival_times,
    lengths_summary,
    shared_prefix_workload,
)

SYSTEM_LEN, QUICK_SYSTEM_LEN = 512, 64
OUTPUT_LENS, QUICK_OUTPUT_LENS = "fixed:32", "fixed:8"


def make_workload(opts: BenchOptions, tokenizer) -> Workload:
    if opts.workload_file:
        return Workload.load(opts.workload_file)
    return shared_prefix_workload(
        tokenizer,
        opts.num_requests,
        opts.seed,
        system_len=QUICK_SYSTEM_LEN if opts.quick else SYSTEM_LEN,
        suffix_lens=opts.prompt_lens or "uniform:16:48",
        output_lens=opts.output_lens or (QUICK_OUTPUT_LENS if opts.quick else OUTPUT_LENS),
    )


def _server_hit_rate(run: dict, workload: Workload, warm: Workload) -> float:
    gauge = run["engine"].get("prefix_cache_hit_rate", 0.0)
    looked_up = workload.total_prompt_tokens
    return gauge * (looked_up + warm.total_prompt_tokens) / looked_up


def run_prefix_cache(opts: BenchOptions) -> dict:
    out_dir = Path(opts.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(opts.model)
    workload = make_workload(opts, tokenizer)
    workload.save(out_dir / "workload.json")
    offsets = arrival_times(len(workload), opts.rate, opts.seed)
    warm = warmup_workload(tokenizer, opts.seed)
    log(f"workload: {lengths_summary(workload)}, {workload.description}")
    t0 = time.perf_counter()
    runs = []
    for caching in (True, False):
        tag = "cache_on" if caching else "cache_off"
        if "inprocess" in opts.modes:
            runs.append(_inprocess(opts, caching, workload, offsets, warm, f"inprocess_{tag}"))
        if "continuous" in opts.modes:
            runs.append(
                _server(opts, caching, workload, offsets, warm, out_dir, f"continuous_{tag}")
            )
    results = {
        "scenario": "prefix-cache",
        "model": opts.model,
        "seed": opts.seed,
        "rate": "inf" if math.isinf(opts.rate) else opts.rate,
        "quick": opts.quick,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "workload": {**lengths_summary(workload), **workload.description},
        "arrivals_s": offsets,
        "runs": runs,
        "roofline": None,
        "prefix_cache": comparison(runs),
        "wall_s": time.perf_counter() - t0,
    }
    finish(results, out_dir)
    log(comparison_text(results["prefix_cache"]))
    return results


def _settings(opts: BenchOptions, caching: bool) -> dict:
    return {**server_overrides(opts, "continuous"), "enable_prefix_caching": caching}


def _inprocess(opts, caching, workload, offsets, warm, label) -> dict:
    from slipstream_bench.inprocess import run_inprocess

    log(f"== in-process engine, enable_prefix_caching={caching}")
    settings = server_run.rendered_settings(_settings(opts, caching))
    run = run_inprocess(settings, workload, offsets, warm, label=label, progress=opts.progress)
    run["prefix_cache_hit_rate"] = run["engine"].get("prefix_cache_hit_rate", 0.0)
    return run


def _server(opts, caching, workload, offsets, warm, out_dir, label) -> dict:
    log(f"== server (continuous), enable_prefix_caching={caching}")
    run = server_run.run_mode(
        label, _settings(opts, caching), workload, offsets, warm, out_dir, progress=opts.progress
    )
    run["prefix_cache_hit_rate"] = _server_hit_rate(run, workload, warm)
    return run


def comparison(runs: list) -> dict:
    """Per path: hit rate, TTFT p50/p90 and tokens/s with and without caching, and ratios."""
    out: dict = {}
    for run in runs:
        path, _, tag = run["label"].rpartition("_cache_")
        s = run["summary"]
        out.setdefault(path, {})[tag] = {
            "hit_rate": run.get("prefix_cache_hit_rate"),
            "tokens_per_s": s["tokens_per_s"],
            "ttft_p50_ms": (s.get("ttft_ms") or {}).get("p50"),
            "ttft_p90_ms": (s.get("ttft_ms") or {}).get("p90"),
            "prefill_tokens": run["steps"].get("prefill_tokens"),
        }
    for path, d in out.items():
        on, off = d.get("on"), d.get("off")
        if on and off and on["tokens_per_s"] and on["ttft_p50_ms"]:
            d["speedup_tokens_per_s"] = on["tokens_per_s"] / off["tokens_per_s"]
            d["ttft_p50_reduction"] = off["ttft_p50_ms"] / on["ttft_p50_ms"]
    return out


def comparison_text(comp: dict) -> str:
    lines = ["prefix caching:"]
    for path, d in comp.items():
        for tag in ("on", "off"):
            if tag in d:
                x = d[tag]
                lines.append(
                    f"  {path:<11} cache {tag:<3}  hit rate {x['hit_rate']:.1%}  "
                    f"TTFT p50 {x['ttft_p50_ms'] or 0:.0f} ms  "
                    f"{x['tokens_per_s']:.1f} tok/s  prefill {x['prefill_tokens']} tok"
                )
        if "speedup_tokens_per_s" in d:
            lines.append(
                f"  {path:<11} caching: {d['speedup_tokens_per_s']:.2f}x tokens/s, "
                f"TTFT p50 {d['ttft_p50_reduction']:.2f}x lower"
            )
    return "\n".join(lines)
