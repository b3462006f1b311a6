"""Decode steps and resident memory per weight format (fp32, bf16, int8, and the embedded
model's own 4-bit GGUF blocks: gguf), in one process.

    python -m slipstream_bench.dtype_steps --batches 1,8,32,64 --rounds 3
    python -m slipstream_bench.dtype_steps --rss      # resident MB after load, one process each

One engine per format, loaded side by side; each round times a decode step at every batch in
every engine, alternating their order, so a machine's drift falls on all of them alike: the
ratios against fp32 are the figures (the absolute times are the machine's). The CPU's flags
are printed with them. ``--rss`` loads each format in a fresh process (a format's memory is
not the others') and prints VmRSS after load and after a short generation, beside the weights'
own bytes and the KV cache's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Optional

from slipstream_bench.decode_steps import _Slipstream, measure

# Issue 25's target: resident memory at most the weights' own bytes, the KV cache and this.
RUNTIME_BUDGET_MB = 300
FORMATS = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "gguf": {"quantization": "gguf"},
}


def _flags() -> str:
    from slipstream.worker.kernels.cpu_features import CpuFeatures

    return repr(CpuFeatures.detect())


def steps(batches: list[int], rounds: int, context: int, n_steps: int, settings: dict) -> dict:
    engines = {
        name: _Slipstream({**settings, **extra}, max(batches)) for name, extra in FORMATS.items()
    }
    times: dict = {name: {b: [] for b in batches} for name in engines}
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for b in batches:
            for name in order:
                result = measure(engines[name], b, context, n_steps, seed=r)
                times[name][b].append(result["decode_step_ms"])
                print(json.dumps({"round": r, "format": name, **result}), flush=True)
    table = {name: {b: statistics.median(v) for b, v in per.items()} for name, per in times.items()}
    return {
        "decode_step_ms": table,
        "vs_fp32": {
            name: {b: table[name][b] / table["float32"][b] for b in batches} for name in table
        },
    }


# As the server's stub process runs it (server/stub/adapter.py: OpenAI Triton kept out
# on a machine without CUDA). weights_mb: the linear layers' weights as held (every product's
# layout, scales and outlier columns included: slipstream_bench.decode_floor), a tied
# embedding counted once, plus the other parameters held (norms; an untied embedding).
_RSS_CHILD = """
import gc, json, sys, torch
from slipstream.worker.device import keep_gpu_compiler_out
keep_gpu_compiler_out(torch.device('cpu'))
from slipstream.core.config import EngineConfig
from slipstream.core.sampling_params import SamplingParams
from slipstream.engine import LLMEngine
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'):
            return int(line.split()[1]) / 1024
settings = json.loads(sys.argv[1])
engine = LLMEngine(EngineConfig.from_dict(settings))
loaded = rss()
engine.generate(['The lighthouse at the end of the pier'] * 4,
                SamplingParams(max_tokens=8, temperature=0))
generated = rss()  # before the counting below, which allocates
from slipstream_bench.decode_floor import step_weight_bytes
model = engine.model
linear = {id(p) for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()}
other = sum(p.numel() * p.element_size() for p in model.parameters()
            if id(p) not in linear and p.device.type != 'meta')
print(json.dumps({'rss_after_load_mb': loaded, 'rss_after_generate_mb': generated,
                  'kv_cache_mb': engine.kv_cache.nbytes / 2**20,
                  'weights_mb': (step_weight_bytes(model) + other) / 2**20}))
"""


def rss(settings: dict) -> dict:
    out = {}
    for name, extra in FORMATS.items():
        proc = subprocess.run(
            [sys.executable, "-c", _RSS_CHILD, json.dumps({**settings, **extra})],
            capture_output=True,
            text=True,
            check=True,
        )
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        budget = row["weights_mb"] + row["kv_cache_mb"] + RUNTIME_BUDGET_MB
        out[name] = {
            **row,
            "budget_mb": budget,
            "over_budget_mb": row["rss_after_generate_mb"] - budget,
        }
    return out


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rss", action="store_true", help="resident memory per format instead")
    p.add_argument("--kv-cache-bytes", type=int, default=256 * 2**20)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    settings = {"kv_cache_memory_bytes": str(args.kv_cache_bytes)}
    if args.rss:
        result = rss(settings)
    else:
        result = steps(
            [int(b) for b in args.batches.split(",")],
            args.rounds,
            args.context,
            args.steps,
            settings,
        )
    result["cpu"] = _flags()
    print(json.dumps(result, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
