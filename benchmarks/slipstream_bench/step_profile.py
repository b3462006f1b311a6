"""Where one engine step's time goes: a decode step and a mixed (decode + prefill chunk)
step at several batch sizes, split into the engine's phases and the forward's parts.

    python -m slipstream_bench.step_profile --batches 8,32,64 --context 300 [--set KEY=VALUE]
        [--sampled temperature=0.8,top_p=0.95]

``--sampled`` decodes every row with those sampling parameters (and a seed per request unless
``seed=none``) instead of greedily; the table then also gives the sampler's share of a step.

Phases (wall clock, per step): schedule, prepare (host-side batch and metadata), forward,
sample (and splitting the tokens per request), update (scheduler bookkeeping) and report
(detokenize, outputs). The forward is split
by timing hooks on the model's modules: linear layers, norms, activation, the rotary
embedding, the paged attention (KV store + attention), embedding; what is left over (residual
adds, rotary application, reshapes, Python in the model code) is ``forward_other``. The hooks
cost a little time themselves: ``forward`` is measured on separate steps without them.
Everything runs on the calling thread (no engine loop).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

PHASES = ("schedule", "prepare", "forward", "sample", "update", "report")
_MISSING = object()


class _Clock:
    """Accumulates wall time per label; nested labels are fine (each is its own total)."""

    def __init__(self) -> None:
        self.total: dict = defaultdict(float)

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - t

        return timed

    def reset(self) -> None:
        self.total.clear()


def _category(module: torch.nn.Module) -> str | None:
    name = type(module).__name__
    if isinstance(module, torch.nn.Linear):
        return "linear"
    if "Norm" in name:
        return "norm"
    if "Rotary" in name:
        return "rotary_embedding"
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    if "Activation" in name or isinstance(module, (torch.nn.SiLU, torch.nn.GELU)):
        return "activation"
    return None


@contextmanager
def module_timers(model: torch.nn.Module, clock: _Clock) -> Iterator[None]:
    """Time every leaf module of a known category (pre/post forward hooks)."""
    handles = []
    starts: dict = {}
    for module in model.modules():
        cat = _category(module)
        if cat is None:
            continue

        def pre(mod, args, _id=id(module)):
            starts[_id] = time.perf_counter()

        def post(mod, args, out, _id=id(module), _cat=cat):
            clock.total[_cat] += time.perf_counter() - starts.pop(_id)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def instrumented(engine, clock: _Clock) -> Iterator[None]:
    """Time the engine's phases and the attention operators (instance attributes shadow
    the methods; removed on exit)."""
    runner, sched = engine.runner, engine.scheduler
    patches = [
        (sched, "schedule", "schedule"),
        (runner, "prepare", "prepare"),
        (runner, "run", "forward"),
        (engine.executor, "_execute_batch", "execute"),
        (sched, "update_from_output", "update"),
        (engine.output_processor, "process", "report"),
    ]
    saved_ops = runner.forward.ops
    saved = [(obj, attr, vars(obj).get(attr, _MISSING)) for obj, attr, _ in patches]
    for obj, attr, label in patches:
        setattr(obj, attr, clock.wrap(label, getattr(obj, attr)))

    class _TimedOps:
        """The runner's operators, the two attention ones timed (the rest as they are)."""

        store_step_kv = staticmethod(clock.wrap("attention_store", saved_ops.store_step_kv))
        paged_attention = staticmethod(clock.wrap("attention", saved_ops.paged_attention))

        def __getattr__(self, name: str):
            return getattr(saved_ops, name)

    runner.forward.ops = _TimedOps()
    try:
        yield
    finally:
        for obj, attr, value in saved:
            if value is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, value)
        runner.forward.ops = saved_ops


def _params(max_tokens: int, sampling: dict | None = None, index: int = 0):
    """Greedy, or ``sampling`` (a seed per request: ``index``, unless ``seed`` is given)."""
    from slipstream.core.sampling_params import SamplingParams

    values = {"temperature": 0.0}
    if sampling:
        values = {"seed": index, **sampling}
        if values["seed"] is None:
            del values["seed"]
    return SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, **values)


def parse_sampling(text: str) -> dict:
    """``temperature=0.8,top_p=0.95,seed=none`` -> SamplingParams fields (numbers coerced)."""
    out: dict = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        out[key] = (
            None
            if value.lower() == "none"
            else (int(value) if key in ("top_k", "seed") else float(value))
        )
    return out


def _random_prompt(rng: random.Random, n: int, vocab: int) -> list:
    return [rng.randrange(100, vocab - 1) for _ in range(n)]


def _fill(
    engine, batch: int, context: int, rng: random.Random, sampling: dict | None = None
) -> list:
    """``batch`` requests decoding at ``context`` tokens: added, then prefilled."""
    vocab = engine.model.get_input_embeddings().num_embeddings
    reqs = [
        engine.add_request(_random_prompt(rng, context, vocab), _params(100_000, sampling, i))
        for i in range(batch)
    ]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        engine.step()
    return reqs


def _time_steps(engine, clock: _Clock, steps: int, make_step: Callable[[], None]) -> dict:
    clock.reset()
    t = time.perf_counter()
    for _ in range(steps):
        make_step()
    wall = (time.perf_counter() - t) / steps
    out = {k: v / steps * 1e3 for k, v in clock.total.items()}
    out["step"] = wall * 1e3
    # sampling and turning tokens into per-request lists: the batch's execution less the rest
    out["sample"] = out.pop("execute", 0.0) - out.get("prepare", 0.0) - out.get("forward", 0.0)
    return out


def _mixed_step(engine, rng: random.Random, chunk: int) -> Callable[[], None]:
    """A step with every decode plus one new prompt's first chunk of ``chunk`` tokens."""
    vocab = engine.model.get_input_embeddings().num_embeddings

    def step() -> None:
        req = engine.add_request(_random_prompt(rng, chunk, vocab), _params(1))
        engine.step()
        engine.abort(req.request_id)

    return step


def profile_batch(
    engine, batch: int, context: int, steps: int, seed: int = 0, sampling: dict | None = None
) -> dict:
    rng = random.Random(seed + batch)
    reqs = _fill(engine, batch, context, rng, sampling)
    budget = engine.config.max_num_batched_tokens
    chunk = max(budget - batch, 2)
    clock = _Clock()
    result = {"batch": batch, "context": context, "mixed_prefill_tokens": chunk}
    with instrumented(engine, clock):
        engine.step()  # warm
        result["decode"] = _time_steps(engine, clock, steps, engine.step)
        result["mixed"] = _time_steps(engine, clock, steps, _mixed_step(engine, rng, chunk))
        with module_timers(engine.model, clock):
            result["decode_parts"] = _time_steps(engine, clock, steps, engine.step)
            result["mixed_parts"] = _time_steps(
                engine, clock, steps, _mixed_step(engine, rng, chunk)
            )
    for key in ("decode_parts", "mixed_parts"):
        parts = result[key]
        known = sum(
            parts.get(k, 0.0)
            for k in (
                "linear",
                "norm",
                "activation",
                "rotary_embedding",
                "embedding",
                "attention",
                "attention_store",
            )
        )
        parts["forward_other"] = parts.get("forward", 0.0) - known
    for req in reqs:
        engine.abort(req.request_id)
    return result


def profile(
    settings: dict, batches: list, context: int, steps: int, sampling: dict | None = None
) -> list:
    from slipstream.core.config import EngineConfig
    from slipstream.engine import LLMEngine

    values = {"max_num_seqs": str(max(batches) + 1), **settings}  # + the mixed step's prompt
    engine = LLMEngine(EngineConfig.from_dict(values))
    with torch.inference_mode():
        return [profile_batch(engine, b, context, steps, sampling=sampling) for b in batches]


def format_table(results: list) -> str:
    cols = ("step", "schedule", "prepare", "forward", "sample", "update", "report")
    parts = (
        "linear",
        "attention",
        "attention_store",
        "norm",
        "activation",
        "rotary_embedding",
        "embedding",
        "forward_other",
    )
    lines = []
    for kind in ("decode", "mixed"):
        lines.append(
            f"{kind} step (ms): batch | "
            + " | ".join(cols)
            + " || forward with hooks: "
            + " | ".join(parts)
        )
        for r in results:
            a, b = r[kind], r[f"{kind}_parts"]
            share = a.get("sample", 0) / a["step"] if a.get("step") else 0.0
            lines.append(
                f"  {r['batch']:>3} | "
                + " | ".join(f"{a.get(c, 0):.1f}" for c in cols)
                + f" || {b.get('forward', 0):.1f}: "
                + " | ".join(f"{b.get(p, 0):.1f}" for p in parts)
                + f" || sample {share:.1%} of the step"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="8,32,64")
    p.add_argument("--context", type=int, default=300, help="tokens of context per sequence")
    p.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--sampled",
        type=parse_sampling,
        default=None,
        metavar="K=V,...",
        help="decode every row sampled, e.g. temperature=0.8,top_p=0.95 (a seed "
        "per request unless seed=none)",
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    settings = dict(item.split("=", 1) for item in args.set)
    results = profile(
        settings,
        [int(b) for b in args.batches.split(",")],
        args.context,
        args.steps,
        sampling=args.sampled,
    )
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
