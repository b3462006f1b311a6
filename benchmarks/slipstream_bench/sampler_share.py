"""The sampler's share of a decode step with every row sampled: this tree's sampler against
the one at another git revision, alternating step by step in ONE process (so a machine
shared with other work slows both alike; compare the ratios, not the milliseconds).

    python -m slipstream_bench.sampler_share --batches 8,32,64 --baseline HEAD~1 \\
        --sampled temperature=0.8,top_p=0.95 [--context 300] [--steps 6] [--set KEY=VALUE]

Per batch size and sampler: the step's wall time, the sampling phase (the batch's execution
less the host-side preparation and the forward) and its share of the step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from slipstream_bench.step_profile import _Clock, _fill, instrumented, parse_sampling

REPO = Path(__file__).resolve().parents[2]
SAMPLER_PATH = "backend/slipstream/worker/sample/sampler.py"


def baseline_sampler_class(revision: str) -> type:
    """``Sampler`` from ``worker/sample/sampler.py`` as it was at ``revision`` (a module of its own;
    it imports the rest of this tree's package)."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{revision}:{SAMPLER_PATH}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="sampler-baseline-")) / "baseline_sampler.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("slipstream_baseline_sampler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.Sampler


class _Launching:
    """A baseline ``Sampler`` from before samplers had ``launch`` (the executor's seam)."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)

    def launch(self, logits, reqs, fetch, want_logprobs: bool = True):
        from slipstream.worker.sample.sampler import PerRequestError, _Sampled

        try:
            return _Sampled(self.sampler(logits, reqs, want_logprobs))
        except PerRequestError as err:
            return _Sampled(error=err)


def _one_step(engine, clock: _Clock) -> dict:
    clock.reset()
    engine.step()
    t = dict(clock.total)
    step = t.get("schedule", 0) + t.get("execute", 0) + t.get("update", 0) + t.get("report", 0)
    return {
        "step": step * 1e3,
        "sample": (t.get("execute", 0) - t.get("prepare", 0) - t.get("forward", 0)) * 1e3,
        "forward": t.get("forward", 0) * 1e3,
    }


def compare_batch(
    engine, samplers: dict, batch: int, context: int, steps: int, sampling: dict
) -> dict:
    """Every sampler in turn on each of ``steps`` rounds of decode steps; per-sampler means."""
    reqs = _fill(engine, batch, context, random.Random(batch), sampling)
    clock = _Clock()
    totals = {name: {"step": 0.0, "sample": 0.0, "forward": 0.0} for name in samplers}
    with instrumented(engine, clock):
        for name, sampler in samplers.items():  # warm each
            engine.sampler = sampler
            engine.step()
        for r in range(steps):
            for name in list(samplers) if r % 2 == 0 else list(samplers)[::-1]:
                engine.sampler = samplers[name]
                for key, value in _one_step(engine, clock).items():
                    totals[name][key] += value / steps
    for req in reqs:
        engine.abort(req.request_id)
    for t in totals.values():
        t["sample_share"] = t["sample"] / t["step"] if t["step"] else 0.0
    return {"batch": batch, "context": context, **totals}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="8,32,64")
    p.add_argument("--baseline", default=None, help="git revision of the sampler to compare")
    p.add_argument(
        "--sampled",
        type=parse_sampling,
        default=parse_sampling("temperature=0.8,top_p=0.95"),
        metavar="K=V,...",
    )
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    from slipstream.core.config import EngineConfig
    from slipstream.engine import LLMEngine

    batches = [int(b) for b in args.batches.split(",")]
    values = {"max_num_seqs": str(max(batches)), **dict(s.split("=", 1) for s in args.set)}
    engine = LLMEngine(EngineConfig.from_dict(values))
    samplers = {"this tree": engine.sampler}
    if args.baseline:
        baseline = baseline_sampler_class(args.baseline)(engine.config.seed)
        samplers[args.baseline] = baseline if hasattr(baseline, "launch") else _Launching(baseline)
    results = []
    with torch.inference_mode():
        for b in batches:
            results.append(
                compare_batch(engine, samplers, b, args.context, args.steps, args.sampled)
            )
            r = results[-1]
            print(
                f"batch {b:>3}: "
                + "; ".join(
                    f"{name}: step {r[name]['step']:.1f} ms, forward {r[name]['forward']:.1f}, "
                    f"sample {r[name]['sample']:.1f} ({r[name]['sample_share']:.1%})"
                    for name in samplers
                ),
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
