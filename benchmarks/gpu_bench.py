#!/usr/bin/env python
"""GPU benchmark for the CUDA path (H100 / H200).

Part 1, kernels (``slipstream.worker.attention.triton_backend``):
  * HBM bandwidth measured with a large device-to-device copy (read + write bytes / time);
  * paged decode attention at each batch x context, against torch SDPA on contiguous K/V, with
    the HBM roofline: the KV bytes the step must read / the measured copy bandwidth;
  * paged prefill attention (fresh prompts and a prefix-cache hit) against SDPA, in TFLOP/s;
  * a correctness check of every kernel against the torch reference.
Part 2, end to end (``slipstream.engine.LLMEngine``, default SmolLM2 model):
  * generated tokens/s at batch 1, 32, 256 (greedy, ignore_eos, fixed output length);
  * greedy outputs on a few prompts compared token for token with the CPU path (fp32): the GPU
    fp32 run must match exactly, the GPU bf16 run is reported as the length of the common prefix.
Part 2 is guarded: if the engine API differs or the model cannot load, part 1 still reports.

Prints a table and writes JSON (``--out``). Timings use ``triton.testing.do_bench`` (median, L2
flushed between repetitions, so small working sets are not served from L2).

    python benchmarks/gpu_bench.py                      # everything
    python benchmarks/gpu_bench.py --skip-engine        # kernels only
    python benchmarks/gpu_bench.py --shapes smollm2,llama8b --batches 1,32,256 --contexts 512,2048
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
import traceback
from functools import partial

# name: (query heads, KV heads, head dim)
SHAPES = {
    "smollm2": (9, 3, 64),  # SmolLM2-135M, the default model
    "llama8b": (32, 8, 128),  # Llama-3-8B geometry, for a KV-heavier comparison
}

DEVICE = "cuda"  # module-level so the helpers can be smoke-tested elsewhere

CORRECTNESS_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--out", default="gpu_bench_results.json", help="JSON results file")
    p.add_argument("--shapes", default="smollm2", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--batches", default="1,32,256", help="decode batch sizes (kernels and engine)")
    p.add_argument("--contexts", default="512,2048", help="decode context lengths")
    p.add_argument("--block-size", type=int, default=16, help="KV cache page size (tokens)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--copy-gib", type=float, default=2.0, help="size of the bandwidth copy")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument(
        "--skip-correctness",
        action="store_true",
        help="skip the CPU-vs-GPU greedy comparison (loads the model on CPU, ~30 s)",
    )
    p.add_argument("--model", default="default", help="engine model ('default' = SmolLM2)")
    p.add_argument("--prompt-len", type=int, default=64, help="engine: prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=128, help="engine: generated tokens/request")
    p.add_argument("--kv-gib", type=float, default=8.0, help="engine: KV cache budget (GiB)")
    p.add_argument("--compare-tokens", type=int, default=32, help="correctness: tokens/prompt")
    return p.parse_args(argv)


def _ints(s):
    return [int(x) for x in s.split(",") if x.strip()]


# ------------------------------------------------------------------------------------ timing


def bench_ms(fn):
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth(gib: float) -> dict:
    """Device-to-device copy: (bytes read + bytes written) / time."""
    import torch

    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": 2 * n, "ms": ms, "GBps": 2 * n / (ms * 1e-3) / 1e9}


# ------------------------------------------------------------------------------------ kernels


def make_paged(batch, lengths, hkv, d, block_size, dtype, seed=0):
    """A paged cache holding ``batch`` sequences of the given lengths on shuffled pages
    (block 0 left unused, like the engine's scratch block)."""
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    pages = [-(-n // block_size) for n in lengths]
    num_blocks = sum(pages) + 1
    kc = torch.randn(num_blocks, block_size, hkv, d, device=DEVICE, dtype=dtype, generator=g)
    vc = torch.randn(num_blocks, block_size, hkv, d, device=DEVICE, dtype=dtype, generator=g)
    perm = (torch.randperm(num_blocks - 1, device=DEVICE, generator=g) + 1).to(torch.int32)
    bt = torch.full((batch, max(pages)), -1, dtype=torch.int32, device=DEVICE)
    at = 0
    for i, n in enumerate(pages):
        bt[i, :n] = perm[at : at + n]
        at += n
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    return kc, vc, bt, seq_lens


def sdpa(q, k, v, **kw):
    """SDPA with GQA; older torch without ``enable_gqa`` gets K/V repeated per query head."""
    import torch.nn.functional as F

    try:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    except TypeError:
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), **kw
        )


def check_kernels(dtype) -> dict:
    """Every kernel against the torch reference on a small ragged case, on the GPU."""
    import torch

    from slipstream.worker.attention import torch_backend as ref, triton_backend as tk

    out = {}
    h, hkv, d, bs = 9, 3, 64, 16
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    lens = [1, 17, 100, 333]
    kc, vc, bt, seq_lens = make_paged(len(lens), lens, hkv, d, bs, dtype, seed=1)
    q = torch.randn(len(lens), h, d, device=DEVICE, dtype=dtype)
    for name, kw in (
        ("decode", {}),
        ("decode window+softcap", dict(sliding_window=50, softcap=30.0)),
    ):
        for splits in (None, 1, 4):
            got = tk.paged_decode_attention(
                q, kc, vc, bt, seq_lens, d**-0.5, num_splits=splits, **kw
            )
            exp = ref.paged_decode_attention(q, kc, vc, bt, seq_lens, d**-0.5, **kw)
            out[f"{name} splits={splits}"] = float((got.float() - exp.float()).abs().max())
    q_lens = [1, 17, 40, 100]  # the last q_len of each context is new: prefix hits and fresh
    cu = torch.tensor(
        [0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=DEVICE
    )
    qp = torch.randn(sum(q_lens), h, d, device=DEVICE, dtype=dtype)
    for name, kw in (
        ("prefill", {}),
        ("prefill window+softcap", dict(sliding_window=50, softcap=30.0)),
    ):
        got = tk.paged_prefill_attention(
            qp, kc, vc, bt, cu, seq_lens, d**-0.5, query_lens_host=q_lens, seq_lens_host=lens, **kw
        )
        exp = ref.paged_prefill_attention(qp, kc, vc, bt, cu, seq_lens, d**-0.5, **kw)
        out[name] = float((got.float() - exp.float()).abs().max())
    kn = torch.randn(5, hkv, d, device=DEVICE, dtype=dtype)
    slots = torch.tensor([3, -1, 40, 77, -1], device=DEVICE)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    tk.store_kv(kn, kn, k1, v1, slots)
    ref.store_kv(kn, kn, k2, v2, slots)
    out["store_kv (exact)"] = 0.0 if torch.equal(k1, k2) and torch.equal(v1, v2) else float("inf")
    return {"max_abs_err": out, "tolerance": tol, "pass": all(v <= tol for v in out.values())}


def bench_decode(shape_name, batch, ctx, block_size, dtype, bw_GBps) -> dict:
    import torch

    from slipstream.worker.attention import triton_backend as tk

    h, hkv, d = SHAPES[shape_name]
    kc, vc, bt, seq_lens = make_paged(batch, [ctx] * batch, hkv, d, block_size, dtype)
    q = torch.randn(batch, h, d, device=DEVICE, dtype=dtype)
    scale = d**-0.5
    # partial, not lambda: the callable holds the tensors only while it is timed, so the del
    # below frees them
    t_paged = bench_ms(partial(tk.paged_decode_attention, q, kc, vc, bt, seq_lens, scale))
    del kc, vc
    # Baseline: SDPA on contiguous K/V of the same size (no paging, no block table).
    qs = q.view(batch, h, 1, d)
    k = torch.randn(batch, hkv, ctx, d, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    t_sdpa = bench_ms(partial(sdpa, qs, k, v, scale=scale))
    del k, v
    torch.cuda.empty_cache()
    elt = torch.tensor([], dtype=dtype).element_size()
    kv_bytes = 2 * batch * ctx * hkv * d * elt
    roof_ms = kv_bytes / (bw_GBps * 1e9) * 1e3
    return {
        "shape": shape_name,
        "batch": batch,
        "ctx": ctx,
        "kv_MB": kv_bytes / 1e6,
        "paged_ms": t_paged,
        "sdpa_ms": t_sdpa,
        "roofline_ms": roof_ms,
        "paged_GBps": kv_bytes / (t_paged * 1e-3) / 1e9,
        "paged_pct_of_roofline": 100 * roof_ms / t_paged,
        "sdpa_pct_of_roofline": 100 * roof_ms / t_sdpa,
        "num_splits": tk._pick_num_splits(
            batch * hkv,
            bt.shape[1] * block_size,
            tk.decode_config(h, hkv, d, block_size, 1, 0, 0.0, False)["BLOCK_N"],
            q.device,
        ),
    }


def bench_prefill(shape_name, case, block_size, dtype) -> dict:
    """case = (num_seqs, cached prefix per seq, new tokens per seq)."""
    import torch

    from slipstream.worker.attention import triton_backend as tk

    h, hkv, d = SHAPES[shape_name]
    nseq, prefix, new = case
    total = prefix + new
    kc, vc, bt, seq_lens = make_paged(nseq, [total] * nseq, hkv, d, block_size, dtype)
    q_lens = [new] * nseq
    cu = torch.arange(0, (nseq + 1) * new, new, dtype=torch.int32, device=DEVICE)
    q = torch.randn(nseq * new, h, d, device=DEVICE, dtype=dtype)
    scale = d**-0.5
    t_paged = bench_ms(
        partial(
            tk.paged_prefill_attention,
            q,
            kc,
            vc,
            bt,
            cu,
            seq_lens,
            scale,
            query_lens_host=q_lens,
            seq_lens_host=[total] * nseq,
        )
    )
    del kc, vc
    qs = q.view(nseq, new, h, d).transpose(1, 2)
    k = torch.randn(nseq, hkv, total, d, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    t_sdpa = None
    try:
        if prefix == 0:
            t_sdpa = bench_ms(partial(sdpa, qs, k, v, is_causal=True, scale=scale))
        else:  # causal aligned to the bottom-right: the new tokens are the last ones
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(new, total)
            t_sdpa = bench_ms(partial(sdpa, qs, k, v, attn_mask=mask, scale=scale))
    except Exception as exc:  # an SDPA backend without GQA or lower-right causal
        print(f"  (sdpa baseline unavailable for {case}: {exc})")
    del k, v
    torch.cuda.empty_cache()
    pairs = nseq * (new * prefix + new * (new + 1) // 2)  # allowed (query, key) pairs
    flops = 4 * h * d * pairs
    return {
        "shape": shape_name,
        "num_seqs": nseq,
        "prefix": prefix,
        "new": new,
        "paged_ms": t_paged,
        "sdpa_ms": t_sdpa,
        "paged_TFLOPs": flops / (t_paged * 1e-3) / 1e12,
        "sdpa_TFLOPs": flops / (t_sdpa * 1e-3) / 1e12 if t_sdpa else None,
    }


def run_kernels(args, results):
    import torch

    dtype = getattr(torch, args.dtype)
    print("== HBM bandwidth (device-to-device copy) ==")
    bw = copy_bandwidth(args.copy_gib)
    results["copy_bandwidth"] = bw
    print(f"  {bw['bytes'] / 2**30:.1f} GiB moved in {bw['ms']:.3f} ms: {bw['GBps']:.0f} GB/s")

    print("== kernel correctness vs torch reference (on GPU) ==")
    chk = check_kernels(dtype)
    results["kernel_check"] = chk
    for k, v in chk["max_abs_err"].items():
        print(f"  {k:32s} max|err| {v:.2e}")
    print(f"  {'PASS' if chk['pass'] else 'FAIL'} (tolerance {chk['tolerance']})")

    print("== paged decode attention ==")
    rows = []
    hdr = (
        f"{'shape':8s} {'batch':>5s} {'ctx':>5s} {'KV MB':>8s} {'splits':>6s} {'paged us':>9s} "
        f"{'sdpa us':>9s} {'roof us':>8s} {'paged GB/s':>10s} {'%roof':>6s} {'sdpa %roof':>10s}"
    )
    print(hdr)
    for shape in args.shapes.split(","):
        for batch in _ints(args.batches):
            for ctx in _ints(args.contexts):
                try:
                    r = bench_decode(shape, batch, ctx, args.block_size, dtype, bw["GBps"])
                except torch.cuda.OutOfMemoryError as exc:
                    print(f"{shape:8s} {batch:5d} {ctx:5d}  OOM: {exc}")
                    torch.cuda.empty_cache()
                    continue
                rows.append(r)
                print(
                    f"{shape:8s} {batch:5d} {ctx:5d} {r['kv_MB']:8.1f} {r['num_splits']:6d} "
                    f"{r['paged_ms'] * 1e3:9.1f} {r['sdpa_ms'] * 1e3:9.1f} "
                    f"{r['roofline_ms'] * 1e3:8.1f} {r['paged_GBps']:10.0f} "
                    f"{r['paged_pct_of_roofline']:6.1f} {r['sdpa_pct_of_roofline']:10.1f}"
                )
    results["decode"] = rows

    print("== paged prefill attention ==")
    print(
        f"{'shape':8s} {'seqs':>4s} {'prefix':>6s} {'new':>5s} {'paged ms':>9s} {'sdpa ms':>8s} "
        f"{'paged TF/s':>10s} {'sdpa TF/s':>9s}"
    )
    rows = []
    for shape in args.shapes.split(","):
        for case in ((1, 0, 2048), (8, 0, 512), (1, 1536, 512), (4, 3584, 512)):
            r = bench_prefill(shape, case, args.block_size, dtype)
            rows.append(r)
            sd = f"{r['sdpa_ms']:8.3f}" if r["sdpa_ms"] else f"{'-':>8s}"
            st = f"{r['sdpa_TFLOPs']:9.1f}" if r["sdpa_TFLOPs"] else f"{'-':>9s}"
            print(
                f"{shape:8s} {case[0]:4d} {case[1]:6d} {case[2]:5d} {r['paged_ms']:9.3f} {sd} "
                f"{r['paged_TFLOPs']:10.1f} {st}"
            )
    results["prefill"] = rows


# ------------------------------------------------------------------------------------ engine


def make_engine(model, device, dtype, **overrides):
    from slipstream import EngineConfig
    from slipstream.engine import LLMEngine

    known = {f.name for f in dataclasses.fields(EngineConfig)}
    kw = dict(model=model, device=device, dtype=dtype)
    kw.update({k: v for k, v in overrides.items() if k in known})
    return LLMEngine(EngineConfig(**kw))


def _release(engine):
    import gc

    import torch

    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy_tokens(engine, prompts, n):
    from slipstream import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in engine.generate(prompts, params)]


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_correctness(args, results):
    print("== greedy outputs: GPU vs CPU (fp32) ==")
    n = args.compare_tokens
    cpu = make_engine(args.model, "cpu", "float32")
    ref = greedy_tokens(cpu, CORRECTNESS_PROMPTS, n)
    text = [cpu.tokenizer.decode(t) for t in ref]
    _release(cpu)
    out = {"prompts": CORRECTNESS_PROMPTS, "cpu_fp32_text": text, "runs": {}}
    for dtype in ("float32", args.dtype):
        if dtype in out["runs"]:
            continue
        eng = make_engine(args.model, "cuda", dtype, kv_cache_memory_bytes=1 << 30)
        got = greedy_tokens(eng, CORRECTNESS_PROMPTS, n)
        ops = getattr(getattr(eng, "runner", None), "ops", None)
        _release(eng)
        prefixes = [common_prefix(a, b) for a, b in zip(ref, got)]
        exact = all(p == n for p in prefixes)
        out["runs"][dtype] = {
            "common_prefix": prefixes,
            "exact": exact,
            "ops": getattr(ops, "__name__", None),
        }
        verdict = (
            "MATCH"
            if exact
            else ("MISMATCH" if dtype == "float32" else "diverges (expected for 16-bit)")
        )
        print(
            f"  cuda {dtype:8s} vs cpu float32: matching tokens per prompt {prefixes} of {n}"
            f" -> {verdict}  [ops: {out['runs'][dtype]['ops']}]"
        )
    for p, t in zip(CORRECTNESS_PROMPTS, text):
        print(f"  {p!r} -> {t!r}")
    results["correctness"] = out


def run_engine(args, results):
    import torch

    from slipstream import SamplingParams

    batches = _ints(args.batches)
    max_b = max(batches)
    print(
        f"== engine throughput ({args.model}, {args.dtype}, prompt {args.prompt_len} tokens, "
        f"{args.max_tokens} generated) =="
    )
    eng = make_engine(
        args.model,
        "cuda",
        args.dtype,
        max_num_seqs=max_b,
        max_num_batched_tokens=max(2048, min(max_b * args.prompt_len, 16384)),
        kv_cache_memory_bytes=int(args.kv_gib * 2**30),
        max_model_len=2048,
    )
    runner = getattr(eng, "runner", None)
    info = {
        "ops": getattr(getattr(runner, "ops", None), "__name__", None),
        "cuda_graphs": getattr(eng.config, "enable_cuda_graphs", None),
        "graph_runner": type(getattr(runner, "graph_runner", None)).__name__,
    }
    print(f"  attention ops: {info['ops']}, enable_cuda_graphs={info['cuda_graphs']}")
    vocab = getattr(eng.model.config, "vocab_size", 32000)
    gen = torch.Generator().manual_seed(0)

    def prompts(b):  # random token ids: distinct prompts, no prefix-cache hits
        return torch.randint(100, vocab - 100, (b, args.prompt_len), generator=gen).tolist()

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    print(f"{'batch':>5s} {'seconds':>8s} {'gen tok/s':>10s} {'total tok/s':>11s} {'ms/step':>8s}")
    for b in batches:
        # Warm-up at this batch size (JIT compilation, graph capture), different prompts.
        eng.generate(prompts(b), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = eng.generate(prompts(b), params)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        gen_tokens = sum(len(o.token_ids) for o in outs)
        r = {
            "batch": b,
            "seconds": dt,
            "generated_tokens": gen_tokens,
            "gen_tok_per_s": gen_tokens / dt,
            "total_tok_per_s": (gen_tokens + b * args.prompt_len) / dt,
            "ms_per_decode_step": dt / args.max_tokens * 1e3,
        }
        rows.append(r)
        print(
            f"{b:5d} {dt:8.2f} {r['gen_tok_per_s']:10.0f} {r['total_tok_per_s']:11.0f} "
            f"{r['ms_per_decode_step']:8.2f}"
        )
    _release(eng)
    results["engine"] = {"info": info, "rows": rows}


# ------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_bench.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: unset it to run the compiled kernels", file=sys.stderr)
        return 2
    for s in args.shapes.split(","):
        if s not in SHAPES:
            print(f"unknown shape {s!r}; choose from {sorted(SHAPES)}", file=sys.stderr)
            return 2
    import triton

    props = torch.cuda.get_device_properties(0)
    results = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "memory_GiB": props.total_memory / 2**30,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dtype": args.dtype,
        "block_size": args.block_size,
        "errors": {},
    }
    print(
        f"device: {props.name} ({props.multi_processor_count} SMs, "
        f"{props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
        f"triton {triton.__version__}"
    )

    def guarded(name, fn):
        try:
            fn(args, results)
        except Exception as exc:
            traceback.print_exc()
            results["errors"][name] = f"{type(exc).__name__}: {exc}"
            print(f"!! {name} failed: {exc}")

    if not args.skip_kernels:
        guarded("kernels", run_kernels)
    if not args.skip_engine:
        if not args.skip_correctness:
            guarded("correctness", run_correctness)
        guarded("engine", run_engine)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"results written to {args.out}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
