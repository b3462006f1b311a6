"""A decode step against its memory floor, per weight format, in one process.

    python -m slipstream_bench.decode_floor --formats float32,bfloat16,int8,gguf --batches 1,8

At a few sequences a decode step reads every weight once, so no step can take less than the
weights' bytes over the machine's memory bandwidth: the floor. Each format's engine (loaded
side by side) runs decode steps with speculation off; each round measures the bandwidth
(``machine_probe``: a streaming read of 1 GiB on the engine's threads) just before and after
its steps, so that a step and the bandwidth it is held to are taken in the same moment of a
shared machine, and alternates the formats' order. Figures are the fastest step of each
round (a step can only be slowed by others), then the median over rounds: the step as the
engine runs it (``engine.step``: scheduling, forward, sampling, output) and its forward alone,
each over the floor. The weights' bytes are what the step reads: every product's packed
layout (scales and outlier columns included), the LM head's too. Where the compiled decode
stack runs the layers, its phases' share of the step is reported too (``--no-phases`` skips
it): where the time goes at one row.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from slipstream_bench.machine_probe import BUFFER_BYTES, Bandwidth, describe_cpu

# --formats names -> engine settings (gguf: the embedded model's own Q4_1 blocks)
FORMATS = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "gguf": {"quantization": "gguf"},
}


@dataclass
class FloorRow:
    format: str
    batch: int
    weight_mb: float
    bandwidth_gbs: float
    floor_ms: float
    step_ms: float  # engine.step
    forward_ms: float  # the model's forward (runner.run) within it
    step_over_floor: float
    forward_over_floor: float
    tokens_per_s: float
    layers_ms: float = 0.0  # the decoder layers (the compiled stack), within the forward
    phases_ms: Optional[dict] = None  # per step, the stack's phases (the first thread's view)


def step_weight_bytes(model: torch.nn.Module) -> int:
    """The bytes a decode step reads of the linear layers' weights: each product's layout
    once (a fused q/k/v or gate/up plan once for its layers), float32 weights as they are."""
    from slipstream.worker.layers.reduced_linear import serving_plan

    seen: set = set()
    total = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        plan = serving_plan(module)
        if plan is None:  # float32: its (packed) weight, 4 bytes a value
            total += module.in_features * module.out_features * 4
            continue
        if id(plan) in seen:
            continue
        seen.add(id(plan))
        layout = next((x for x in (plan.q8, plan.q4, plan.panels) if x is not None), None)
        if layout is not None:
            total += layout.nbytes if hasattr(layout, "nbytes") else layout.packed.nbytes
        else:
            held = plan.held()
            total += held.nbytes if held is not None else 0
        if plan.bias is not None:
            total += plan.bias.nbytes
    return total


class _Engine:
    def __init__(self, name: str, settings: dict, batch: int) -> None:
        from slipstream.core.config import EngineConfig
        from slipstream.engine import LLMEngine

        self.name = name
        config = {"max_num_seqs": str(batch), "enable_prefix_caching": "false", **settings}
        self.engine = LLMEngine(EngineConfig.from_dict(config))
        self.weight_bytes = step_weight_bytes(self.engine.model)
        self.forward_s: list[float] = []
        self.layers_s: list[float] = []
        run = self.engine.runner.run
        lean = self.engine.runner.forward.lean
        self.stack = lean.stack if lean is not None else None
        if self.stack is not None:
            stack_run = self.stack.run

            def timed_layers(*args, **kwargs):
                start = time.perf_counter()
                out = stack_run(*args, **kwargs)
                self.layers_s.append(time.perf_counter() - start)
                return out

            self.stack.run = timed_layers  # type: ignore[method-assign]

        def timed(batch_):
            start = time.perf_counter()
            out = run(batch_)
            self.forward_s.append(time.perf_counter() - start)
            return out

        self.engine.runner.run = timed

    def steps(self, batch: int, context: int, n: int, seed: int) -> tuple[float, float, float]:
        """The fastest of ``n`` decode steps at ``batch`` sequences of ``context`` tokens:
        (engine step seconds, forward seconds, layers' seconds)."""
        from slipstream.core.sampling_params import SamplingParams

        rng = random.Random(seed)
        warm = -(-batch * context // 2048) + 2  # the prompts' chunks, then two decode steps
        params = SamplingParams(max_tokens=n + warm + 2, temperature=0, ignore_eos=True)
        for i in range(batch):
            prompt = [rng.randrange(100, 40000) for _ in range(context)]
            self.engine.add_request(prompt, params, request_id=f"{self.name}-{seed}-{i}")
        engine = self.engine
        for _ in range(warm):
            engine.step()
        steps, forwards, layers = [], [], []
        for _ in range(n):
            self.forward_s.clear()
            self.layers_s.clear()
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
            forwards.append(sum(self.forward_s))
            layers.append(sum(self.layers_s))
        while engine.has_unfinished():
            engine.step()
        return min(steps), min(forwards), min(layers)

    def phases(self, batch: int, context: int, n: int) -> Optional[dict]:
        """Milliseconds a step spends in each of the stack's phases, averaged over ``n``."""
        if self.stack is None:
            return None
        self.stack.time_phases(True)
        self.stack.phase_times()
        try:
            self.steps(batch, context, n, seed=10_000)
            return {k: v * 1e3 / n for k, v in self.stack.phase_times().items()}
        finally:
            self.stack.time_phases(False)


def run(
    formats: list[str],
    batches: list[int],
    rounds: int,
    context: int,
    steps: int,
    phases: bool = True,
    model: str = "default",
    bandwidth_bytes: int = BUFFER_BYTES,
) -> dict:
    bandwidth = Bandwidth(bandwidth_bytes)
    extra = {} if model == "default" else {"model": model}
    engines = [_Engine(f, {**FORMATS[f], **extra}, max(batches)) for f in formats]
    found: dict = {(e.name, b): [] for e in engines for b in batches}
    for r in range(rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        for b in batches:
            for e in order:
                before = bandwidth.measure()
                step_s, forward_s, layers_s = e.steps(b, context, steps, seed=r)
                after = bandwidth.measure()
                found[(e.name, b)].append((max(before, after), step_s, forward_s, layers_s))
                print(
                    json.dumps(
                        {
                            "round": r,
                            "format": e.name,
                            "batch": b,
                            "gbs": max(before, after) / 1e9,
                            "step_ms": step_s * 1e3,
                            "forward_ms": forward_s * 1e3,
                        }
                    ),
                    flush=True,
                )
    rows = []
    for e in engines:
        for b in batches:
            runs = found[(e.name, b)]
            bw = statistics.median(x[0] for x in runs)
            step_s = statistics.median(x[1] for x in runs)
            forward_s = statistics.median(x[2] for x in runs)
            layers_s = statistics.median(x[3] for x in runs)
            floor = e.weight_bytes / bw
            rows.append(
                FloorRow(
                    e.name,
                    b,
                    e.weight_bytes / 2**20,
                    bw / 1e9,
                    floor * 1e3,
                    step_s * 1e3,
                    forward_s * 1e3,
                    step_s / floor,
                    forward_s / floor,
                    b / step_s,
                    layers_s * 1e3,
                    e.phases(b, context, steps) if phases else None,
                )
            )
    return {"cpu": describe_cpu().line(), "context": context, "rows": [asdict(r) for r in rows]}


def format_table(result: dict) -> str:
    lines = [
        result["cpu"],
        f"{'format':<9} {'batch':>5} {'weights MB':>10} {'GB/s':>6} {'floor ms':>8} "
        f"{'step ms':>8} {'x floor':>7} {'fwd ms':>7} {'x floor':>7} {'tok/s':>7}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['format']:<9} {r['batch']:>5} {r['weight_mb']:>10.1f} {r['bandwidth_gbs']:>6.1f} "
            f"{r['floor_ms']:>8.2f} {r['step_ms']:>8.2f} {r['step_over_floor']:>7.2f} "
            f"{r['forward_ms']:>7.2f} {r['forward_over_floor']:>7.2f} {r['tokens_per_s']:>7.1f}"
        )
    timed = [r for r in result["rows"] if r.get("phases_ms")]
    if timed:
        names = list(timed[0]["phases_ms"])
        lines.append("where a step's layers go (ms, the stack's phases; layers = their sum):")
        lines.append(
            f"{'format':<9} {'batch':>5} {'layers':>7} " + " ".join(f"{n:>12}" for n in names)
        )
        for r in timed:
            lines.append(
                f"{r['format']:<9} {r['batch']:>5} {r['layers_ms']:>7.2f} "
                + " ".join(f"{r['phases_ms'][n]:>12.3f}" for n in names)
            )
    return "\n".join(lines)


def parse_formats(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """``--formats``: comma-separated names of ``FORMATS`` (an unknown one is an error)."""
    formats = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        parser.error(f"unknown formats {unknown}; choose from {sorted(FORMATS)}")
    return formats


def publish(table: str, result: dict, path: Optional[str]) -> None:
    """The table on stdout, the figures as JSON at ``path`` where given."""
    print(table, flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="bfloat16,int8,gguf")
    p.add_argument("--batches", default="1")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per round")
    p.add_argument("--no-phases", action="store_true", help="skip the per-phase breakdown")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    formats = parse_formats(p, args.formats)
    result = run(
        formats,
        [int(b) for b in args.batches.split(",")],
        args.rounds,
        args.context,
        args.steps,
        not args.no_phases,
    )
    publish(format_table(result), result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
