"""Prompt tokens per second per weight format, against the CPU's peak.

    python -m slipstream_bench.prompt_rate --formats bfloat16,int8,gguf --chunks 128,512,2048

Two figures per format and chunk size, in one process (the engines loaded side by side, the
formats' order alternating by round, the fastest of each round's repeats, the median over
rounds):

* ``step``: one prefill step of a single prompt of that many tokens through the engine
  (``engine.step``: every layer, attention included, and the first token's sampling);
* ``products``: the model's linear products alone on that many rows (each product's layout as
  the engine holds it, the q/k/v and gate/up ones fused), as multiply-adds per second and as
  a share of the peak rate of the instruction they run on (``machine_probe``: vdpbf16ps for
  bf16, vpdpbusd for int8 and 4-bit), on the engine's threads.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from slipstream_bench.decode_floor import FORMATS, parse_formats, publish
from slipstream_bench.machine_probe import describe_cpu, peak_macs_per_second


@dataclass
class PromptRow:
    format: str
    chunk: int
    step_ms: float
    step_tokens_per_s: float
    products_ms: float
    products_gmacs: float  # multiply-adds per second, 1e9
    peak_gmacs: float
    share_of_peak: float


def products_of(model: torch.nn.Module) -> list[tuple[Callable, int, int]]:
    """Each product the forward runs once per layer: (callable on [T, K], K, N)."""
    from slipstream.worker.layers import reduced_linear as rl

    out, seen = [], set()
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        plan = rl.serving_plan(module)
        if plan is None or id(plan) in seen:
            continue
        seen.add(id(plan))
        out.append((rl.product_of(plan), module.in_features, plan.out_features))
    return out


class _Engine:
    def __init__(self, name: str, settings: dict, chunk: int) -> None:
        from slipstream.core.config import EngineConfig
        from slipstream.engine import LLMEngine

        config = {
            "max_num_batched_tokens": str(max(chunk, 2048)),
            "enable_prefix_caching": "false",
            **settings,
        }
        self.name = name
        self.engine = LLMEngine(EngineConfig.from_dict(config))
        self.products = products_of(self.engine.model)
        self.weight_format = self.engine.weight_format

    def step_seconds(self, chunk: int, seed: int) -> float:
        from slipstream.core.sampling_params import SamplingParams

        rng = random.Random(seed)
        prompt = [rng.randrange(100, 40000) for _ in range(chunk)]
        params = SamplingParams(max_tokens=1, temperature=0)
        self.engine.add_request(prompt, params, request_id=f"{self.name}-{chunk}-{seed}")
        start = time.perf_counter()
        self.engine.step()
        elapsed = time.perf_counter() - start
        while self.engine.has_unfinished():
            self.engine.step()
        return elapsed

    @torch.inference_mode()
    def products_seconds(self, chunk: int, seed: int) -> tuple[float, int]:
        """The products' time on ``chunk`` rows, and their multiply-adds."""
        gen = torch.Generator().manual_seed(seed)
        total, macs = 0.0, 0
        for product, k, n in self.products:
            x = torch.randn(chunk, k, generator=gen)
            start = time.perf_counter()
            product(x)
            total += time.perf_counter() - start
            macs += chunk * k * n
        return total, macs


def run(formats: list[str], chunks: list[int], rounds: int, repeats: int) -> dict:
    engines = [_Engine(f, FORMATS[f], max(chunks)) for f in formats]
    peaks = {e.name: peak_macs_per_second(e.weight_format) for e in engines}
    found: dict = {(e.name, c): [] for e in engines for c in chunks}
    for r in range(rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        for c in chunks:
            for e in order:
                step = min(e.step_seconds(c, seed=r * 100 + i) for i in range(repeats))
                timed = [e.products_seconds(c, seed=i) for i in range(repeats)]
                products = min(t for t, _ in timed)
                found[(e.name, c)].append((step, products, timed[0][1]))
                print(
                    json.dumps(
                        {
                            "round": r,
                            "format": e.name,
                            "chunk": c,
                            "step_ms": step * 1e3,
                            "products_ms": products * 1e3,
                        }
                    ),
                    flush=True,
                )
    rows = []
    for e in engines:
        for c in chunks:
            runs = found[(e.name, c)]
            step = statistics.median(x[0] for x in runs)
            products = statistics.median(x[1] for x in runs)
            macs = runs[0][2]
            rate = macs / products
            peak = peaks[e.name]
            rows.append(
                PromptRow(
                    e.name,
                    c,
                    step * 1e3,
                    c / step,
                    products * 1e3,
                    rate / 1e9,
                    peak / 1e9,
                    rate / peak if peak else 0.0,
                )
            )
    return {"cpu": describe_cpu().line(), "rows": [asdict(r) for r in rows]}


def format_table(result: dict) -> str:
    lines = [
        result["cpu"],
        f"{'format':<9} {'chunk':>5} {'step ms':>8} {'tok/s':>8} {'GEMM ms':>8} "
        f"{'GMAC/s':>8} {'peak':>8} {'share':>6}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['format']:<9} {r['chunk']:>5} {r['step_ms']:>8.1f} {r['step_tokens_per_s']:>8.0f} "
            f"{r['products_ms']:>8.1f} {r['products_gmacs']:>8.1f} {r['peak_gmacs']:>8.1f} "
            f"{r['share_of_peak']:>6.1%}"
        )
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="bfloat16,int8,gguf")
    p.add_argument("--chunks", default="128,256,512,1024,2048")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    formats = parse_formats(p, args.formats)
    chunks = [int(c) for c in args.chunks.split(",")]
    result = run(formats, chunks, args.rounds, args.repeats)
    publish(format_table(result), result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
