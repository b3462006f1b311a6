"""What multi-LoRA costs a decode step: step time with and without adapters at batch B,
the variants interleaved step by step in one process (the machine's noise hits all alike).

    python -m slipstream_bench.lora_cost --batches 8,32 --context 128 --steps 60

Variants, each its own engine holding B decoding requests of ``context`` random prompt tokens:
``base`` (LoRA off), ``lora-none`` (LoRA on, no request names an adapter), ``lora-one`` (every
request on one adapter), ``lora-mixed`` (requests spread over two adapters and the base
model), and ``base`` / ``lora-mixed`` on the transformers forward (``fast_forward=false``)
to compare the two model paths. The adapters are random rank-``rank`` PEFT adapters on all
seven projections, written here (PEFT's file layout) so the benchmark needs no PEFT.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slipstream.core.config import EngineConfig
from slipstream.core.sampling_params import SamplingParams
from slipstream.engine import LLMEngine
from slipstream.worker.lora.adapter import TARGET_MODULES
from slipstream.worker.model.loader import load_model, resolve_model_path

# variant -> (engine settings, adapter of each request in turn: None is the base model)
VARIANTS = {
    "base": ({"enable_lora": False}, [None]),
    "lora-none": ({}, [None]),
    "lora-one": ({}, ["a"]),
    "lora-mixed": ({}, ["a", "b", None]),
    "base-hf": ({"enable_lora": False, "fast_forward": False}, [None]),
    "lora-mixed-hf": ({"fast_forward": False}, ["a", "b", None]),
}


def write_adapter(target: Path, model: torch.nn.Module, rank: int, seed: int) -> Path:
    """A PEFT-layout adapter with random A and B on every targeted projection."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGET_MODULES:
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = (
                torch.randn(rank, module.in_features, generator=gen) * 0.01
            )
            tensors[f"{key}.lora_B.weight"] = (
                torch.randn(module.out_features, rank, generator=gen) * 0.01
            )
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / "adapter_model.safetensors"))
    (target / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(TARGET_MODULES),
                "bias": "none",
            }
        )
    )
    return target


def start(engine: LLMEngine, batch: int, context: int, names: list, seed: int) -> None:
    """B requests decoding (prefill done) with room for every timed step."""
    rng = random.Random(seed)
    for i in range(batch):
        prompt = [rng.randrange(100, 40000) for _ in range(context)]
        engine.add_request(
            prompt,
            SamplingParams(
                max_tokens=4096, ignore_eos=True, temperature=0.0, lora_name=names[i % len(names)]
            ),
        )
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()


def measure(engines: dict, batch: int, context: int, steps: int) -> dict:
    for i, (name, engine) in enumerate(engines.items()):
        start(engine, batch, context, VARIANTS[name][1], seed=batch)
        engine.step()  # warm-up at this batch size
    times = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            t = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t)
    for engine in engines.values():
        for rid in list(engine.requests):
            engine.abort(rid)
    # Other processes only ever add time to a step: the fastest steps (min, 20th percentile)
    # are the least disturbed estimate; the median is reported beside them.
    stats = {
        name: {
            "min_ms": min(t) * 1e3,
            "p20_ms": _quantile(t, 0.2) * 1e3,
            "median_ms": statistics.median(t) * 1e3,
        }
        for name, t in times.items()
    }
    for name, s in stats.items():
        for key in ("min", "p20", "median"):
            s[f"{key}_vs_base"] = s[f"{key}_ms"] / stats["base"][f"{key}_ms"]
    return stats


def _quantile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); 1 keeps a loaded machine's "
        "OpenMP barriers out of the figures",
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    path = resolve_model_path(args.model)
    work = Path(tempfile.mkdtemp(prefix="lora-cost-"))
    probe = load_model(path, torch.float32, torch.device("cpu"))
    adapters = {
        name: str(write_adapter(work / name, probe, args.rank, seed))
        for seed, name in enumerate(("a", "b"))
    }
    del probe
    common = dict(
        model=str(path),
        max_num_seqs=max(batches),
        max_model_len=2048,
        kv_cache_memory_bytes=384 * 2**20,
        enable_prefix_caching=False,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=args.rank,
        lora_modules=adapters,
    )
    engines = {}
    for name in args.variants.split(","):
        settings = {**common, **VARIANTS[name][0]}
        if not settings["enable_lora"]:
            settings.pop("lora_modules")
        engines[name] = LLMEngine(EngineConfig(**settings))
    results = {
        "cpu": _cpu_model(),
        "threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()),
        "rank": args.rank,
        "context": args.context,
        "batches": {},
    }
    for b in batches:
        results["batches"][b] = measure(engines, b, args.context, args.steps)
        print(
            json.dumps(
                {"batch": b, "load_average": list(os.getloadavg()), **results["batches"][b]}
            ),
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
