"""The batching scenario: one workload through every mode, then the roofline, then files.

Order: the in-process engine with the continuous server's exact engine settings, the three
server modes (each its own tritonserver, started and stopped in turn), the two Hugging Face
baselines; with ``repeat`` > 1 that many rounds, every other one in reverse order, and the
median round of each mode is reported. Last the roofline (it rewrites the plain model's weight
layout), on the steps of the reported continuous run.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from slipstream_bench import plots, report, server_run, timeline
from slipstream_bench.agreement import greedy_agreement
from slipstream_bench.driver import Arrivals
from slipstream_bench.goodput import Slo, goodput, slo_summary
from slipstream_bench.workload import (
    SamplingMix,
    Workload,
    apply_sampling,
    arrival_times,
    generate_workload,
    lengths_summary,
)

SERVER_MODES = ("static", "dynamic", "continuous")
# slipstream_bench.vllm_peer; *_bf16: vLLM with dtype bfloat16, its best on an AVX512-BF16 CPU
PEER_MODES = ("vllm_triton", "vllm_triton_bf16", "vllm_offline")
# vLLM offline without torch.compile (enforce_eager): what compiling gives vLLM; on request only
EXTRA_MODES = ("vllm_offline_eager", "vllm_offline_bf16")
# llama.cpp's llama-server on the default model's GGUF (slipstream_bench.llamacpp_peer);
# skipped unless scripts/setup_llamacpp.sh has built it
LLAMACPP_MODES = ("llamacpp_q8_0", "llamacpp_q4_1", "llamacpp_bf16", "llamacpp_f32")
DEFAULT_MODES = (
    SERVER_MODES
    + ("inprocess", "hf_static", "hf_continuous")
    + PEER_MODES
    + ("roofline",)
    + LLAMACPP_MODES
)
ALL_MODES = DEFAULT_MODES + EXTRA_MODES
QUICK_PROMPT_LENS = "uniform:8:48"
QUICK_OUTPUT_LENS = "0.75*uniform:4:12+0.25*uniform:24:32"
GIB = 1024**3


@dataclass
class BenchOptions:
    model: str = "default"
    num_requests: int = 64
    seed: int = 0
    workload_file: Optional[str] = None
    rate: float = math.inf
    modes: tuple = DEFAULT_MODES
    output_dir: Path = Path("benchmarks/results")
    quick: bool = False
    progress: bool = True
    prompt_lens: Optional[str] = None
    output_lens: Optional[str] = None
    static_batch_size: int = 8
    kv_cache_memory_bytes: int = GIB  # the whole offline workload fits: no preemption
    settings: dict = field(default_factory=dict)  # extra engine settings (--set)
    repeat: int = 1  # rounds of every mode; the median round of each is reported
    peers_dir: Optional[Path] = None  # where scripts/setup_peers.py installed the peers
    variants: dict = field(default_factory=dict)  # name -> extra settings: inprocess[name] runs
    variant_modes: tuple = ("inprocess",)  # which modes each variant runs as (and continuous)
    rates: tuple = ()  # a sweep of Poisson rates (requests/s); empty: ``rate`` alone
    # an automatic sweep (``--rates auto``): from ``rates[0]`` up by ``sweep_step`` until every
    # mode keeps fewer than the SLO's share of requests inside it
    sweep_until_all_fail: bool = False
    sweep_step: float = 1.0
    max_rate: float = 64.0  # an automatic sweep stops here whatever happens
    max_in_flight: int = 0  # > 0: a closed loop (1: one request at a time)
    sampling: SamplingMix = field(default_factory=SamplingMix)  # greedy unless set
    prefix_caching: Optional[bool] = None  # None: as each engine ships it (both on)
    slo: Slo = field(default_factory=Slo)

    @property
    def all_rates(self) -> tuple:
        return tuple(self.rates) or (self.rate,)


def log(message: str) -> None:
    print(message, flush=True)


def load_tokenizer(model: str):
    from slipstream.worker.model.loader import load_tokenizer as load, resolve_model_path

    return load(resolve_model_path(model))


def make_workload(opts: BenchOptions, tokenizer) -> Workload:
    if opts.workload_file:
        return Workload.load(opts.workload_file)
    from slipstream_bench.workload import DEFAULT_OUTPUT_LENS, DEFAULT_PROMPT_LENS

    quick = opts.quick
    prompt = opts.prompt_lens or (QUICK_PROMPT_LENS if quick else DEFAULT_PROMPT_LENS)
    output = opts.output_lens or (QUICK_OUTPUT_LENS if quick else DEFAULT_OUTPUT_LENS)
    return generate_workload(tokenizer, opts.num_requests, opts.seed, prompt, output)


def warmup_workload(tokenizer, seed: int) -> Workload:
    # Other words than the workload's (another seed): no prefix-cache hits carried over.
    return generate_workload(tokenizer, 2, seed + 7919, "fixed:32", "fixed:4")


def server_overrides(opts: BenchOptions, batching: str) -> dict:
    caching = (
        {}
        if opts.prefix_caching is None
        else {"enable_prefix_caching": str(opts.prefix_caching).lower()}
    )
    return {
        "model": opts.model,
        "batching": batching,
        "max_batch_size": opts.static_batch_size,
        "kv_cache_memory_bytes": opts.kv_cache_memory_bytes,
        **caching,
        **opts.settings,
    }


# The CPU features that decide which kernels run (AVX-512, VNNI, BF16, AMX).
SIMD_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "avx_vnni",
)


def cpu_info() -> dict:
    """CPU model and its SIMD flags (from /proc/cpuinfo; empty where there is none)."""
    model, flags = platform.processor() or "", []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu_model": model, "cpu_flags": flags}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            have = set(value.split())
            flags = [f for f in SIMD_FLAGS if f in have]
    return {"cpu_model": model, "cpu_flags": flags}


def load_average() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def machine() -> dict:
    import torch
    import transformers

    return {
        "cpus": os.cpu_count(),
        **cpu_info(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_1m": load_average(),
    }


# ------------------------------------------------------------------------ the runs
def on_fresh_thread(fn: Callable[[], object]) -> object:
    """Run ``fn`` on a new thread and return its result (or raise its exception).

    A thread that runs a parallel torch op keeps an OpenMP pool until it exits, and while
    more pool threads than cores exist libgomp stops spinning at barriers: whatever
    computes on another thread (the engine loop, Hugging Face's continuous-batching thread)
    then runs 30-100% slower. So the main thread never computes, and each mode's own
    compute ends with its thread."""
    result: list = []
    error: list = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="bench-run")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def guarded(label: str, kind: str, fn: Callable[[], dict]) -> dict:
    """One mode's failure (a server that will not start, an API that changed) is recorded
    in the results and the other modes still run. Each mode runs on a fresh thread."""
    try:
        return on_fresh_thread(fn)
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed
        log(f"!! {label} failed: {exc!r}\n{traceback.format_exc()}")
        return {"label": label, "kind": kind, "error": repr(exc), "summary": {}}


@dataclass
class _Shared:
    """What every mode of one benchmark run uses."""

    opts: BenchOptions
    workload: Workload
    offsets: list
    warm: Workload
    out_dir: Path
    hf_model_and_tok: Optional[tuple] = None  # loaded on first use
    peer: Optional[object] = None  # the vLLM peer, looked up on first use
    peer_missing: Optional[str] = None  # why it is skipped
    tag: str = ""  # the rate, in the files of a sweep's runs
    # modes an automatic sweep no longer runs: they already fell below the SLO at a lower rate
    retired: set = field(default_factory=set)

    def vllm_peer(self):
        """The installed vLLM peer, or None (the reason in ``peer_missing``, said once)."""
        if self.peer is None and self.peer_missing is None:
            from slipstream_bench.vllm_peer import PeerUnavailable, load_peer

            try:
                self.peer = load_peer(self.opts.peers_dir)
            except PeerUnavailable as exc:
                self.peer_missing = str(exc)
                log(f"!! vLLM peer modes skipped: {exc}")
        return self.peer

    def hf(self) -> tuple:
        if self.hf_model_and_tok is None:
            from slipstream_bench.hf_baselines import load_hf

            self.hf_model_and_tok = on_fresh_thread(lambda: load_hf(self.opts.model))
        return self.hf_model_and_tok


def run_mode(mode: str, sh: _Shared, round_index: int) -> dict:
    """One run of one mode (guarded: a failure is recorded, the others go on)."""
    opts, wl, offsets, warm = sh.opts, sh.workload, sh.offsets, sh.warm
    suffix = sh.tag + (f"_r{round_index}" if opts.repeat > 1 else "")
    base, name = split_variant(mode)
    if base == "continuous" and name:
        extra = opts.variants[name]
        log(f"== server, batching=continuous {extra}{suffix}")
        run = guarded(
            mode,
            "triton",
            lambda: server_run.run_mode(
                f"continuous_{name}{suffix}",
                {**server_overrides(opts, "continuous"), **extra},
                wl,
                offsets,
                warm,
                sh.out_dir,
                progress=opts.progress,
            ),
        )
    elif mode in SERVER_MODES:
        log(f"== server, batching={mode}{suffix}")
        run = guarded(
            mode,
            "triton",
            lambda: server_run.run_mode(
                mode + suffix,
                server_overrides(opts, mode),
                wl,
                offsets,
                warm,
                sh.out_dir,
                progress=opts.progress,
            ),
        )
    elif base == "inprocess":
        from slipstream_bench.inprocess import run_inprocess

        extra = opts.variants[name] if name else {}
        log(
            f"== in-process engine (no Triton), the continuous server's settings "
            f"{extra or ''}{suffix}"
        )
        settings = server_run.rendered_settings({**server_overrides(opts, "continuous"), **extra})
        run = guarded(
            mode,
            "inprocess",
            lambda: run_inprocess(settings, wl, offsets, warm, label=mode, progress=opts.progress),
        )
    elif mode in ("hf_static", "hf_continuous") and wl.sampled:
        run = {
            "label": mode,
            "kind": "hf",
            "summary": {},
            "skipped": "the Hugging Face baselines decode greedily only",
        }
    elif mode == "hf_static":
        from slipstream_bench import hf_baselines as hf

        log(f"== Hugging Face generate, padded static batches of {opts.static_batch_size}{suffix}")
        model, tok = sh.hf()
        run = guarded(
            mode,
            "hf",
            lambda: hf.run_hf_static(
                model,
                tok,
                wl,
                offsets,
                warm,
                batch_size=opts.static_batch_size,
                progress=opts.progress,
            ),
        )
    elif mode == "hf_continuous":
        from slipstream_bench import hf_baselines as hf

        log(f"== Hugging Face continuous batching (sdpa){suffix}")
        model, tok = sh.hf()
        run = guarded(
            mode,
            "hf",
            lambda: hf.run_hf_continuous(model, tok, wl, offsets, warm, progress=opts.progress),
        )
        hf.release(model)
    elif mode in PEER_MODES + EXTRA_MODES:
        run = run_peer(mode, sh, suffix)
    elif mode in LLAMACPP_MODES:
        run = run_llamacpp(mode, sh)
    else:
        raise ValueError(f"not a runnable mode: {mode}")
    run["label"], run["round"] = mode, round_index
    gc.collect()
    return run


def run_peer(mode: str, sh: _Shared, suffix: str) -> dict:
    """Triton + vllm_backend, or vLLM offline; skipped (not failed) when not installed."""
    from slipstream_bench import vllm_peer

    peer = sh.vllm_peer()
    if peer is None:
        return {"label": mode, "kind": "peer", "skipped": sh.peer_missing, "summary": {}}
    import torch

    settings = server_run.rendered_settings(server_overrides(sh.opts, "continuous"))
    dtype = "bfloat16" if mode.endswith("_bf16") else "float32"
    args = vllm_peer.engine_args(
        peer,
        sh.opts.model,
        int(settings.get("max_model_len") or 2048),
        sh.opts.seed,
        max_num_seqs=int(settings.get("max_num_seqs") or 64),
        max_num_batched_tokens=int(settings.get("max_num_batched_tokens") or 2048),
        prefix_caching=sh.opts.prefix_caching,
        dtype=dtype,
    )
    threads = torch.get_num_threads()
    if mode in ("vllm_triton", "vllm_triton_bf16"):
        log(f"== Triton + Triton's vLLM backend (vLLM {peer.version}, {dtype}){suffix}")
        return guarded(
            mode,
            "peer_triton",
            lambda: vllm_peer.run_triton(
                peer,
                args,
                sh.workload,
                sh.offsets,
                sh.warm,
                sh.out_dir,
                threads,
                mode + suffix,
                progress=sh.opts.progress,
            ),
        )
    if mode == "vllm_offline_eager":
        args = {**args, "enforce_eager": True}
    log(
        f"== vLLM {peer.version} offline, "
        f"LLM.generate{' (eager)' * args.get('enforce_eager', False)}"
        f" {dtype}{suffix}"
    )
    return guarded(
        mode,
        "peer_offline",
        lambda: vllm_peer.run_offline(peer, args, sh.workload, sh.warm, threads, mode + suffix),
    )


def run_llamacpp(mode: str, sh: _Shared) -> dict:
    """llama-server on a GGUF of the default model; skipped (not failed) when not built."""
    from slipstream_bench import llamacpp_peer
    from slipstream_bench.vllm_peer import default_peers_dir

    try:
        peer = llamacpp_peer.load_peer(sh.opts.peers_dir or default_peers_dir())
    except llamacpp_peer.PeerUnavailable as exc:
        return {"label": mode, "kind": "peer", "skipped": str(exc), "summary": {}}
    if llamacpp_peer.MODES[mode] not in peer.gguf:
        why = f"no {llamacpp_peer.MODES[mode].upper()} GGUF; {llamacpp_peer.SETUP_HINT}"
        return {"label": mode, "kind": "peer", "skipped": why, "summary": {}}
    if sh.opts.model not in ("default", "", None):
        return {
            "label": mode,
            "kind": "peer",
            "summary": {},
            "skipped": "llama.cpp runs the default model's GGUF only",
        }
    import torch

    log(f"== llama.cpp llama-server {llamacpp_peer.MODES[mode].upper()}")
    return guarded(
        mode,
        "peer_llamacpp",
        lambda: llamacpp_peer.run(
            peer,
            mode,
            sh.workload,
            sh.offsets,
            sh.out_dir,
            torch.get_num_threads(),
            sh.opts.progress,
        ),
    )


def split_variant(mode: str) -> tuple:
    """``inprocess[fast]`` -> ("inprocess", "fast"); ``continuous`` -> ("continuous", None)."""
    if mode.endswith("]") and "[" in mode:
        base, name = mode[:-1].split("[", 1)
        return base, name
    return mode, None


def variant_labels(variant_modes: tuple, variants: dict) -> list:
    """``inprocess``/``continuous``: every variant in that mode; ``continuous:NAME``: one."""
    labels = []
    for item in variant_modes:
        base, _, only = item.partition(":")
        labels += [f"{base}[{name}]" for name in variants if not only or name == only]
    return labels


def run_rounds(sh: _Shared) -> list:
    """Every selected mode once per round. Rounds alternate the order (A B C, C B A, ...) so
    that a drift in the machine's speed falls evenly on every mode."""
    variants = tuple(variant_labels(sh.opts.variant_modes, sh.opts.variants))
    order = [
        m
        for m in ("inprocess",)
        + SERVER_MODES
        + ("hf_static", "hf_continuous")
        + PEER_MODES
        + EXTRA_MODES
        + LLAMACPP_MODES
        if m in sh.opts.modes and m not in sh.retired
    ]
    order += [v for v in variants if v not in sh.retired]
    runs = []
    for r in range(sh.opts.repeat):
        for mode in order if r % 2 == 0 else order[::-1]:
            runs.append(run_mode(mode, sh, r))
            _save_partial(sh, runs[-1])
    return runs


def _save_partial(sh: _Shared, run: dict) -> None:
    """Each run's summary as soon as it ends (runs.jsonl): a long run stopped half-way keeps
    what it measured."""
    if sh.out_dir is None:
        return
    line = {k: v for k, v in run.items() if k not in PER_REQUEST_KEYS}
    with open(Path(sh.out_dir) / "runs.jsonl", "a") as f:
        f.write(json.dumps(line, default=str) + "\n")


def _speed(run: dict) -> float:
    return run["summary"].get("tokens_per_s") or 0.0


def _attainment(run: dict) -> float:
    return ((run.get("slo") or {}).get("attainment")) or 0.0


def representatives(runs: list, by_slo: bool = False) -> list:
    """One run per mode, the median by tokens/s, or by SLO attainment for arrivals over time
    (``by_slo``; rounds with equal attainment ranked by tokens/s, so that three rounds all at
    100% give the median speed, not the first; failed rounds count as worst), each with every
    round's tokens/s in
    ``rounds_tokens_per_s`` (and attainment in ``rounds_slo_attainment``); modes in first-run
    order."""
    by_mode: dict = {}
    for run in runs:
        by_mode.setdefault(run["label"], []).append(run)
    out = []
    for mode, group in by_mode.items():
        ranked = sorted(group, key=lambda r: (_attainment(r) if by_slo else 0.0, _speed(r)))
        chosen = dict(ranked[(len(ranked) - 1) // 2])  # the lower median of an even count
        chosen["rounds_tokens_per_s"] = [r["summary"].get("tokens_per_s") for r in group]
        chosen["rounds_slo_attainment"] = [(r.get("slo") or {}).get("attainment") for r in group]
        out.append(chosen)
    return out


def run_roofline(runs: list, model, workload: Workload) -> Optional[dict]:
    from slipstream_bench import roofline

    source = next(
        (r for r in runs if r["label"] == "continuous" and r.get("timeline")), None
    ) or next((r for r in runs if r["label"] == "inprocess" and r.get("timeline")), None)
    if source is None:
        log("roofline skipped: no continuous run with a step trace")
        return None
    log(f"== roofline: raw forwards at the shapes of the {source['label']} run's steps")
    steps = steps_from_json(source["timeline"])
    result = roofline.roofline(model, steps)
    result["source"] = source["label"]
    if result.get("best_possible_s"):
        result["best_tokens_per_s"] = workload.total_output_tokens / result["best_possible_s"]
        result["efficiency"] = roofline.efficiency(
            result, source["summary"]["makespan_s"], source["steps"].get("busy_s", 0.0)
        )
    return result


def steps_from_json(items: list) -> list:
    return [
        timeline.Step(
            i, start, dur, [timeline.Slice(rid, slot, p, d) for rid, slot, p, d in slices], pads
        )
        for i, start, dur, slices, pads in items
    ]


# ------------------------------------------------------------------------ the scenario
def run_batching(opts: BenchOptions) -> dict:
    out_dir = Path(opts.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "runs.jsonl").unlink(missing_ok=True)
    tokenizer = load_tokenizer(opts.model)
    workload = apply_sampling(make_workload(opts, tokenizer), opts.sampling, opts.seed)
    workload.save(out_dir / "workload.json")
    warm = warmup_workload(tokenizer, opts.seed)
    log(f"workload: {lengths_summary(workload)}")
    t0 = time.perf_counter()
    machine_at_start = machine()
    sh = _Shared(opts, workload, [], warm, out_dir)
    sweep = run_sweep(sh)
    runs, offsets = sweep[0]["runs"], sweep[0]["arrivals_s"]
    roof = None
    if "roofline" in opts.modes:
        model = sh.hf()[0]
        roof = guarded("roofline", "roofline", lambda: run_roofline(runs, model, workload))
    sh.hf_model_and_tok = None
    gc.collect()
    results = {
        "scenario": "batching",
        "model": opts.model,
        "seed": opts.seed,
        "rate": _rate_value(opts.all_rates[0]),
        "quick": opts.quick,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_at_start,
        "workload": {**lengths_summary(workload), **workload.description},
        "prefix_caching": (
            "engine default" if opts.prefix_caching is None else opts.prefix_caching
        ),
        "slo": vars(opts.slo).copy(),
        "arrivals_s": offsets,
        "runs": runs,
        "roofline": roof,
        "wall_s": time.perf_counter() - t0,
    }
    if len(sweep) > 1:
        results["sweep"] = [{"rate": _rate_value(p["rate"]), "runs": p["runs"]} for p in sweep]
    results["goodput"] = goodputs(sweep, opts.slo)
    if not workload.sampled:
        results["greedy_agreement"] = greedy_agreement(runs)
    results["machine"]["load_average_1m_at_end"] = load_average()
    results["targets"] = report.judged(results)
    return finish(results, out_dir)


def _rate_value(rate: float):
    return "inf" if math.isinf(rate) else rate


def run_sweep(sh: _Shared) -> list:
    """Every rate of ``--rates``; or, for an automatic sweep, rates from the first one up by
    ``sweep_step`` until every mode keeps fewer than the SLO's share of requests inside it
    (a mode that fell below stops running: its goodput is known)."""
    opts = sh.opts
    if not opts.sweep_until_all_fail:
        return [run_rate(sh, rate) for rate in opts.all_rates]
    sweep: list = []
    rate = opts.all_rates[0]
    while rate <= opts.max_rate:
        point = run_rate(sh, rate)
        sweep.append(point)
        for run in point["runs"]:
            if run.get("slo") is None or _attainment(run) < opts.slo.attainment:
                sh.retired.add(run["label"])
        if not point["runs"] or all(run["label"] in sh.retired for run in point["runs"]):
            break
        rate = round(rate + opts.sweep_step, 6)
    return sweep


def run_rate(sh: _Shared, rate: float) -> dict:
    """Every mode (``repeat`` rounds) on the workload sent at ``rate``; each run gets its
    SLO attainment, and the representative round per mode is chosen by it for arrivals over
    time (by tokens/s for a burst)."""
    sh.offsets = Arrivals(
        arrival_times(len(sh.workload), rate, sh.opts.seed), sh.opts.max_in_flight
    )
    sweeping = len(sh.opts.all_rates) > 1 or sh.opts.sweep_until_all_fail
    sh.tag = f"_rate{rate:g}" if sweeping else ""
    if sh.tag:
        log(f"==== rate {rate:g} requests/s")
    rounds = run_rounds(sh)
    for run in rounds:
        run["slo"] = slo_summary(run, sh.opts.slo)
        run["rate"] = _rate_value(rate)
    return {
        "rate": rate,
        "arrivals_s": list(sh.offsets),
        "runs": representatives(rounds, by_slo=not math.isinf(rate)),
    }


def goodputs(sweep: list, slo: Slo) -> dict:
    """Per mode with per-token times: goodput over the measured rates (a burst counts as no
    rate: it has none to report)."""
    points: dict = {}
    for point in sweep:
        if math.isinf(point["rate"]):
            continue
        for run in point["runs"]:
            if run.get("slo"):
                points.setdefault(run["label"], []).append(
                    (point["rate"], run["slo"]["attainment"])
                )
    return {label: {**goodput(p, slo), "points": sorted(p)} for label, p in points.items()}


PER_REQUEST_KEYS = ("records", "timeline", "arrivals_s", "output_token_ids")


def _lean(runs: list) -> list:
    return [{k: v for k, v in run.items() if k not in PER_REQUEST_KEYS} for run in runs]


def summary_of(results: dict) -> dict:
    """``results`` without the per-request and per-step data: small enough to commit."""
    out = {k: v for k, v in results.items() if k not in PER_REQUEST_KEYS}
    out["runs"] = _lean(results.get("runs", []))
    if results.get("sweep"):
        out["sweep"] = [{"rate": p["rate"], "runs": _lean(p["runs"])} for p in results["sweep"]]
    return out


def finish(results: dict, out_dir: Path) -> dict:
    results["plots"] = plots.write_all(results, out_dir)
    path = out_dir / "results.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    (out_dir / "summary.json").write_text(json.dumps(summary_of(results), indent=1, default=str))
    log("\n" + report.table(results))
    if results.get("goodput") or any(r.get("slo") for r in results.get("runs", [])):
        log("\n" + report.slo_table(results))
    if results.get("targets"):
        log(report.targets_text(results))
    if results.get("greedy_agreement"):
        log("\n" + report.agreement_table(results["greedy_agreement"]))
    log(
        f"\nresults: {path} (summary.json: without per-request data)\n"
        f"plots:   {', '.join(results['plots'])}"
    )
    return results
