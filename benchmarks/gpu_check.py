#!/usr/bin/env python
"""The GPU check: Slipstream's CUDA path on one H100 / H200 in one command (under 5 minutes).

Needs only this repository and what a CUDA PyTorch image has (torch, triton, transformers): no
network, no model files. Random weights (never zeros) are drawn on the device for real model
geometries -- SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B -- with the embedded model's tokenizer
(``benchmarks/data/smollm2-tokenizer``). Reported as a table and as JSON (``--out``):

* correctness: the engine's greedy tokens scored by transformers in fp32 on the same weights
  (teacher forcing: the share of positions where the engine's token is the reference's argmax
  or within a tie margin), fp32 and bf16, with chunked prefill, prefix-cache hits, CUDA
  graphs on and off (``slipstream_bench.gpu_correctness``);
* memory: how the engine shared out the GPU (``gpu_memory_utilization`` of the total);
* kernels: decode attention's bytes per second against a device-to-device copy's bandwidth,
  batch 1-256, context 512-8k (``slipstream_bench.gpu_kernels``);
* engine: batch-1 inter-token latency, tokens/s at batch 64 and 256, against the roofline
  (weight + KV bytes over the copy bandwidth) and transformers ``generate``
  (``slipstream_bench.gpu_engine``);
* profile: a decode step's device busy time against its wall time, and its top kernels.

    python benchmarks/gpu_check.py [--out gpu_check.json] [--budget-s 280]
    python benchmarks/gpu_check.py --smoke      # tiny shapes on CPU (Triton's interpreter)

A part that fails is reported with its error and the others still run; parts that would run
past the time budget are skipped and say so.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Plan:
    device: str
    budget_s: float
    copy_bytes: int
    # kernels: (shape name, query heads, KV heads, head dim)
    attention_shapes: tuple
    batches: tuple
    contexts: tuple
    max_cache_bytes: int
    # models, in order of importance: (geometry, correctness variants (dtype, graphs))
    models: tuple
    work_prompts: int
    work_lengths: tuple
    work_shared: int
    work_tokens: int
    engine_settings: dict = field(default_factory=dict)
    speed_batches: tuple = (1, 64, 256)
    speed_prompt: int = 128
    speed_steps: int = 32
    speed_tokens: int = 8192  # the speed engines' max_num_batched_tokens
    speed_kv_bytes: int = 16 * 2**30
    generate_tokens: int = 32
    profile_model: str = "llama-3.2-1b"
    profile_batch: int = 64
    sized_model: str = "smollm2-135m"  # its speed engine sizes its memory as vLLM does


ALL_VARIANTS = (("float32", True), ("float32", False), ("bfloat16", True), ("bfloat16", False))
FULL = Plan(
    device="cuda",
    budget_s=280.0,
    copy_bytes=2 * 2**30,
    attention_shapes=(("llama-3.2-1b", 32, 8, 64), ("llama-3.1-8b", 32, 8, 128)),
    batches=(1, 8, 32, 64, 128, 256),
    contexts=(512, 1024, 2048, 4096, 8192),
    max_cache_bytes=12 * 2**30,
    models=(
        ("llama-3.2-1b", ALL_VARIANTS),
        ("smollm2-135m", ALL_VARIANTS),
        ("llama-3.1-8b", (("bfloat16", True), ("float32", True))),
    ),
    work_prompts=12,
    work_lengths=(700, 40, 300, 5, 1100, 160),
    work_shared=256,
    work_tokens=32,
    engine_settings=dict(
        block_size=16,
        max_num_seqs=16,
        max_num_batched_tokens=512,  # prompts longer than this are chunked
        max_model_len=2048,
        kv_cache_memory_bytes=4 * 2**30,
        cuda_graph_batch_sizes=(1, 2, 4, 8, 16),
    ),
)
SMOKE = Plan(
    device="cpu",
    budget_s=600.0,
    copy_bytes=2**22,
    attention_shapes=(("tiny", 4, 2, 16),),
    batches=(1, 2),
    contexts=(32,),
    max_cache_bytes=2**22,
    models=(("tiny", (("float32", True), ("bfloat16", True))),),
    work_prompts=4,
    work_lengths=(20, 3),
    work_shared=8,
    work_tokens=4,
    engine_settings=dict(
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=128,
        kv_cache_memory_bytes=2**22,
        attention_ops="triton",  # the GPU's kernels, interpreted
        fast_forward=False,  # transformers' forward, as on the GPU
    ),
    speed_batches=(1, 2),
    speed_prompt=8,
    speed_steps=2,
    speed_tokens=16,
    speed_kv_bytes=2**22,
    generate_tokens=2,
    profile_model="tiny",
    profile_batch=2,
    sized_model="",
)


class Clock:
    def __init__(self, budget_s: float) -> None:
        self.start, self.budget = time.perf_counter(), budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()


class Report:
    """Every part's results (or its error, or why it was skipped), for the JSON and tables."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.data: dict = {"parts": {}}

    def part(
        self,
        name: str,
        fn: Callable[[], object],
        needs_s: float = 0.0,
        summary: Callable[[object], object] = lambda result: result,
    ) -> object:
        """Run one part; its result (``summary`` of it goes to the report), or None."""
        if self.clock.left() < needs_s:
            self.data["parts"][name] = {"skipped": f"time budget ({self.clock.left():.0f} s left)"}
            print(f"[{self.clock.elapsed():6.1f}s] {name}: skipped (time budget)", flush=True)
            return None
        start = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - one part failing must not hide the others
            self.data["parts"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{self.clock.elapsed():6.1f}s] {name}: FAILED {exc}", flush=True)
            traceback.print_exc()
            return None
        took = time.perf_counter() - start
        self.data["parts"][name] = {"seconds": round(took, 2), "result": summary(result)}
        print(f"[{self.clock.elapsed():6.1f}s] {name}: done in {took:.1f}s", flush=True)
        return result


def environment(device) -> dict:
    import torch
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1))
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def release(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_model(
    report: Report, plan: Plan, name: str, variants, tokenizer, device, copy_bw
) -> None:
    import torch

    from slipstream_bench import gpu_correctness, gpu_engine, gpu_profile
    from slipstream_bench.gpu_models import GEOMETRIES, build_models

    geometry = GEOMETRIES[name]
    models = report.part(
        f"{name}: random weights",
        lambda: build_models(geometry, device),
        summary=lambda m: {"parameters": sum(p.numel() for p in m.reference.parameters())},
    )
    if models is None:
        return
    work = gpu_correctness.make_workload(
        plan.work_prompts,
        plan.work_lengths,
        plan.work_shared,
        plan.work_tokens,
        min(geometry.vocab, 49152),
    )
    for dtype_name, graphs in variants:
        dtype = getattr(torch, dtype_name)
        label = f"{name}: correctness {dtype_name} cuda_graphs={'on' if graphs else 'off'}"
        report.part(
            label,
            lambda: gpu_correctness.check(
                models, tokenizer, dtype, graphs, device, work, plan.engine_settings
            ).row(),
            needs_s=10,
        )
        release(device)
    report.part(
        f"{name}: engine speed",
        lambda: speed(plan, models, name, tokenizer, device, copy_bw, gpu_engine, gpu_profile),
        needs_s=20,
    )
    models.release()
    release(device)


def speed(plan: Plan, models, name, tokenizer, device, copy_bw, gpu_engine, gpu_profile) -> dict:
    settings = {
        k: v
        for k, v in plan.engine_settings.items()
        if k not in ("max_num_seqs", "kv_cache_memory_bytes", "cuda_graph_batch_sizes")
    }
    batch = max(plan.speed_batches)
    # whole prompts in few steps; the sized model's engine takes what vLLM's sizing leaves
    settings["max_num_batched_tokens"] = max(settings["max_num_batched_tokens"], plan.speed_tokens)
    if name != plan.sized_model:
        settings["kv_cache_memory_bytes"] = plan.speed_kv_bytes
    engine = gpu_engine.make_engine(models, tokenizer, device, batch, settings)
    out: dict = {"rows": []}
    if engine.memory_plan is not None:
        out["memory"] = engine.memory_plan.describe()
    for b in plan.speed_batches:
        row = gpu_engine.decode_speed(
            engine, models, device, b, plan.speed_prompt, plan.speed_steps, copy_bw
        )
        tps, ms = gpu_engine.generate_speed(
            models, device, b, plan.speed_prompt, plan.generate_tokens
        )
        row.transformers_tokens_per_s, row.transformers_ms_per_token = tps, ms
        out["rows"].append(row.row())
        release(device)
    if name == plan.profile_model:  # requests in flight, then a few profiled steps
        from slipstream import SamplingParams

        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, detokenize=False)
        for i in range(plan.profile_batch):
            engine.add_request([3 + (i * 7 + j) % 500 for j in range(plan.speed_prompt)], params)
        while any(r.num_output_tokens < 1 for r in engine.requests.values()):
            engine.step()
        out["profile"] = gpu_profile.profile_decode_steps(engine, device).row()
        while engine.has_unfinished():
            engine.step()
    del engine
    return out


def run(plan: Plan, out_path: Path) -> dict:
    import torch

    from slipstream_bench import gpu_kernels
    from slipstream_bench.gpu_models import load_tokenizer

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (the references)
    device = torch.device(plan.device)
    clock = Clock(plan.budget_s)
    report = Report(clock)
    report.data["environment"] = environment(device)
    copy_bw = report.part(
        "copy bandwidth", lambda: gpu_kernels.copy_bandwidth(device, plan.copy_bytes)
    )
    copy_bw = copy_bw or 1.0
    report.data["copy_gb_per_s"] = copy_bw / 1e9
    release(device)
    for shape, heads, kv_heads, head_dim in plan.attention_shapes:
        report.part(
            f"decode attention {shape}",
            lambda: [
                r.row()
                for r in gpu_kernels.decode_attention_sweep(
                    device,
                    shape,
                    heads,
                    kv_heads,
                    head_dim,
                    list(plan.batches),
                    list(plan.contexts),
                    copy_bw,
                    plan.max_cache_bytes,
                )
            ],
            needs_s=15,
        )
        release(device)
    tokenizer = load_tokenizer()
    for name, variants in plan.models:
        check_model(report, plan, name, variants, tokenizer, device, copy_bw)
    report.data["seconds"] = round(clock.elapsed(), 1)
    out_path.write_text(json.dumps(report.data, indent=1, default=str))
    print_tables(report.data)
    return report.data


def print_tables(data: dict) -> None:
    parts = data["parts"]
    env = data["environment"]
    print(
        f"\n## GPU check ({env.get('gpu', env.get('cpu'))}, torch {env['torch']}, "
        f"triton {env['triton']}, {data['seconds']} s)\n"
    )
    print(f"copy bandwidth: {data['copy_gb_per_s']:.1f} GB/s\n")
    print("| correctness | positions | exact | within margin | margin | prefix hits | steps |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, part in parts.items():
        r = part.get("result")
        if "correctness" in name and isinstance(r, dict):
            print(
                f"| {name} | {r['positions']} | {r['exact']:.2%} | {r['within_margin']:.2%} "
                f"| {r['margin']} | {r['prefix_cache_hit_tokens']} | {r['steps']} |"
            )
    print("\n| decode attention | batch | context | us | GB/s | of copy |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, part in parts.items():
        if name.startswith("decode attention") and isinstance(part.get("result"), list):
            for r in part["result"]:
                print(
                    f"| {r['shape']} | {r['batch']} | {r['context']} | {r['microseconds']:.1f} "
                    f"| {r['gb_per_s']:.0f} | {r['share_of_copy']:.0%} |"
                )
    print(
        "\n| engine | batch | ctx | step ms | tok/s | roofline ms | of roofline "
        "| transformers tok/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, part in parts.items():
        r = part.get("result")
        if name.endswith("engine speed") and isinstance(r, dict):
            for row in r["rows"]:
                print(
                    f"| {row['model']} | {row['batch']} | {row['context']} "
                    f"| {row['step_ms']:.3f} | {row['tokens_per_s']:.0f} "
                    f"| {row['roofline_ms']:.3f} | {row['share_of_roofline']:.0%} "
                    f"| {row['transformers_tokens_per_s'] or 0:.0f} |"
                )
            if "memory" in r:
                print(f"\n{r['memory']}")
            if "profile" in r:
                p = r["profile"]
                print(
                    f"\nprofile ({name}): wall {p['wall_ms']:.3f} ms/step, device busy "
                    f"{p['device_busy_ms']:.3f} ms ({p['busy_share']:.0%})"
                )
                for kernel, ms, calls, share in p["top"]:
                    print(f"  {ms:8.3f} ms {calls:6.1f} calls {share:5.1%}  {kernel}")
    failed = {k: v for k, v in parts.items() if "error" in v or "skipped" in v}
    for name, part in failed.items():
        print(f"\n{name}: {part.get('error') or part.get('skipped')}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check.json", help="JSON results file")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI)")
    p.add_argument("--budget-s", type=float, default=None, help="time budget in seconds")
    args = p.parse_args(argv)
    plan = SMOKE if args.smoke else FULL
    if args.budget_s is not None:
        plan = Plan(**{**plan.__dict__, "budget_s": args.budget_s})
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    for path in (REPO / "backend", REPO / "benchmarks"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    data = run(plan, Path(args.out))
    return 1 if any("error" in v for v in data["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
