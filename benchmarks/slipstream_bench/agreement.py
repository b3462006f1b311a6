"""Greedy outputs of systems serving the same weights in the same format, compared request by
request: Slipstream fp32 / bf16 / int8 / 4-bit against llama.cpp's F32 / BF16 / Q8_0 / Q4_1 of
the same GGUF. Matched formats round differently (llama.cpp's Q8_0 quantizes activations per
block as Slipstream's int8 does, but sums in another order), so agreement is a share, not a
promise: a low share where formats match points at a bug on one side."""

from __future__ import annotations

from typing import Optional

# llama.cpp's GGUF type -> the Slipstream weight format holding the same values
LLAMACPP_FORMATS = {"f32": "fp32", "bf16": "bf16", "q8_0": "int8", "q4_1": "4bit"}
# Slipstream's quantization setting -> its format (dtype decides the rest)
QUANTIZATION_FORMATS = {"int8": "int8", "gguf": "4bit", "q4": "4bit", "awq": "4bit", "gptq": "4bit"}


def weight_format(run: dict) -> Optional[str]:
    """The weight format a run served, where it is one a peer can match."""
    if run.get("kind") == "peer_llamacpp":
        from slipstream_bench.llamacpp_peer import MODES

        return LLAMACPP_FORMATS.get(MODES.get(run["label"], ""))
    settings = run.get("settings") or {}
    if run.get("kind") not in ("triton", "inprocess"):
        return None
    quantization = str(settings.get("quantization") or "").lower()
    if quantization in QUANTIZATION_FORMATS:
        return QUANTIZATION_FORMATS[quantization]
    dtype = str(settings.get("dtype") or "auto").lower()
    return "bf16" if dtype in ("bfloat16", "bf16") else "fp32"


def compare(a: list, b: list) -> Optional[dict]:
    """Two runs' records (same workload, same order): the share of identical outputs and the
    mean share of the longer output that the common prefix covers."""
    pairs = [(x.get("text", ""), y.get("text", "")) for x, y in zip(a, b)]
    pairs = [(x, y) for x, y in pairs if x or y]
    if not pairs:
        return None
    prefix = [_common_prefix(x, y) / max(len(x), len(y)) for x, y in pairs]
    return {
        "requests": len(pairs),
        "identical": sum(1 for x, y in pairs if x == y) / len(pairs),
        "mean_prefix_share": sum(prefix) / len(prefix),
    }


def _common_prefix(x: str, y: str) -> int:
    n = 0
    for cx, cy in zip(x, y):
        if cx != cy:
            break
        n += 1
    return n


def greedy_agreement(runs: list) -> list:
    """For each format served by both a Slipstream run and a llama.cpp run: their agreement."""
    slipstream: dict = {}
    peers: dict = {}
    for run in runs:
        fmt = weight_format(run)
        if fmt is None or not run.get("records"):
            continue
        side = peers if run.get("kind") == "peer_llamacpp" else slipstream
        side.setdefault(fmt, run)
    rows = []
    for fmt, peer in peers.items():
        ours = slipstream.get(fmt)
        if ours is None:
            continue
        result = compare(ours["records"], peer["records"])
        if result is not None:
            rows.append(
                {"format": fmt, "slipstream": ours["label"], "peer": peer["label"], **result}
            )
    return rows
