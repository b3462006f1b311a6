"""Compile every Triton kernel for sm_90 (H100) without a GPU.

The interpreter (test_triton_kernels.py, beside this file) accepts things the real compiler
rejects (16-bit ``tl.dot`` shapes, dtype mismatches, unsupported ops), so the GPU code path
(16-bit dots with fp32 accumulation) is checked here by a full ``triton.compile`` down to a
cubin (Triton's wheel bundles ``ptxas``). ``TRITON_INTERPRET`` is read when ``@triton.jit``
decorates, and the test session sets it, so the compile runs in a child process with it unset.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(r"""
    import json, os, sys, time
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from slipstream.worker.attention import triton_backend as tk

    TARGET = GPUTarget("cuda", 90, 32)
    DT = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}

    def compile_kernel(fn, cfg, ptr_types, float_args=()):
        cfg = dict(cfg)
        options = {k: cfg.pop(k) for k in ("num_warps", "num_stages") if k in cfg}
        signature, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in cfg:
                signature[name] = "constexpr"
            elif name in ptr_types:
                signature[name] = ptr_types[name]
                attrs[(i,)] = [["tt.divisibility", 16]]  # what a real launch specialises
            elif name in float_args:
                signature[name] = "fp32"
            else:
                signature[name] = "i32"
                if name.startswith("stride_"):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(fn=fn, signature=signature, constexprs=cfg, attrs=attrs)
        k = triton.compile(src, target=TARGET, options=options)
        assert k.asm.get("cubin"), "no cubin"
        return {"shared": k.metadata.shared, "num_warps": k.metadata.num_warps,
                "ptx_bytes": len(k.asm["ptx"])}

    results = {}
    def run(name, *a, **kw):
        t = time.time()
        info = compile_kernel(*a, **kw)
        info["seconds"] = round(time.time() - t, 2)
        results[name] = info

    for src_t, cache_t, hkv, d in (("bf16", "bf16", 3, 64), ("fp32", "bf16", 8, 80)):
        run(f"store_kv {src_t}->{cache_t} hkv={hkv} d={d}", tk._store_kv_kernel,
            tk.store_kv_config(hkv, d, 16),
            {"K": DT[src_t], "V": DT[src_t], "KC": DT[cache_t], "VC": DT[cache_t], "Slots": "*i64"})

    # (dtype, H, Hkv, D, splits, window, softcap)
    for dt, h, hkv, d, splits, window, cap in (("bf16", 9, 3, 64, 4, 4096, 50.0),
                                               ("fp16", 32, 4, 128, 1, 0, 0.0),
                                               ("fp32", 4, 4, 80, 1, 0, 0.0)):
        cfg = tk.decode_config(h, hkv, d, 16, splits, window, cap, dt == "fp32")
        ptrs = {"Q": DT[dt], "KC": DT[dt], "VC": DT[dt], "BT": "*i32", "SeqLens": "*i32",
                "Out": DT[dt], "MidO": "*fp32", "MidLse": "*fp32"}
        run(f"decode {dt} H={h} Hkv={hkv} D={d} splits={splits} window={window} softcap={cap}",
            tk._decode_kernel, cfg, ptrs, ("scale", "softcap"))
    run("decode_reduce bf16 D=64 splits=4", tk._decode_reduce_kernel,
        tk.decode_reduce_config(64, 4), {"MidO": "*fp32", "MidLse": "*fp32", "Out": "*bf16"})

    for dt, h, hkv, d, window, cap in (("bf16", 9, 3, 64, 4096, 50.0),
                                        ("bf16", 32, 8, 128, 0, 0.0),
                                        ("fp32", 4, 4, 80, 0, 0.0)):
        cfg = tk.prefill_config(h, hkv, d, 16, window, cap, dt == "fp32")
        ptrs = {"Q": DT[dt], "KC": DT[dt], "VC": DT[dt], "BT": "*i32", "CuQ": "*i32",
                "SeqLens": "*i32", "Out": DT[dt]}
        run(f"prefill {dt} H={h} Hkv={hkv} D={d} window={window} softcap={cap}",
            tk._prefill_kernel, cfg, ptrs, ("scale", "softcap"))
    print("RESULTS " + json.dumps(results))
""")


def test_kernels_compile_to_sm90_cubin(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence the 3.9 default-change warning
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert line, proc.stdout
    import json

    results = json.loads(line[-1][len("RESULTS ") :])
    assert len(results) == 9
    for name, info in results.items():
        # H100 allows 227 KB of shared memory per block; stay well inside it.
        assert info["shared"] <= 160 * 1024, (name, info)
