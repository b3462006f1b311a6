"""AWQ and GPTQ checkpoints in Hugging Face format served as they ship (``quantization=awq`` /
``gptq``, 4 bits, CPU): each quantized linear layer's packed tensors become a 4-bit weight
(``layers/quantization/awq``, ``gptq``) without a float copy; the model is ``model/llama``'s
module tree (plain Llama architectures).

What the checkpoint keeps unquantized (the LM head, by these tools' default) is held as int8
blocks (Q8_0's scheme), as a GGUF's head is; embeddings and norms load as float32, as every
CPU model's do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from slipstream.worker.layers.quantization import awq, gptq, int4, int8 as q8_weight
from slipstream.worker.layers.reduced_linear import applied_plan, apply_plan, loaded_plan
from slipstream.worker.model import llama

SCHEMES = ("awq", "gptq")
PACKED = ("qweight", "qzeros", "scales", "g_idx")  # a quantized layer's tensors


def quantization_config(path: Path) -> dict:
    config = path / llama.CONFIG_FILE
    raw = json.loads(config.read_text()) if config.exists() else {}
    return raw.get("quantization_config") or {}


def scheme(path: Path) -> Optional[str]:
    """``awq`` / ``gptq`` where the directory's checkpoint ships that scheme, else None."""
    method = str(quantization_config(path).get("quant_method", "")).lower()
    return method if method in SCHEMES else None


def _check(path: Path, quantization: str, config: dict) -> None:
    method = str(config.get("quant_method", "")).lower() or None
    if method != quantization:
        raise ValueError(
            f"quantization={quantization}, but {path} holds "
            f"{method + ' weights' if method else 'weights without a quantization_config'}"
        )
    if int(config.get("bits", 4)) != 4:
        raise ValueError(f"{quantization} checkpoints of {config.get('bits')} bits are not served")
    if quantization == "awq" and str(config.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version {config.get('version')!r} is not served (only GEMM)")
    if quantization == "awq" and not config.get("zero_point", True):
        raise ValueError("AWQ checkpoints without zero points are not served")


def _layout(
    quantization: str, config: dict, tensors: dict[str, torch.Tensor], name: str
) -> int4.Int4Weight:
    group = int(config.get("group_size", 128))
    qweight, qzeros, scales = (tensors.pop(f"{name}.{t}") for t in PACKED[:3])
    if quantization == "awq":
        return awq.weight(qweight, qzeros, scales, group)
    g_idx = tensors.pop(f"{name}.g_idx", None)
    fmt = str(config.get("checkpoint_format", "gptq")).lower()
    return gptq.weight(qweight, qzeros, scales, g_idx, group, 0 if fmt == "gptq_v2" else 1)


def load(path: Path, quantization: str) -> llama.LlamaForCausalLM:
    """The AWQ / GPTQ checkpoint at ``path``, its quantized layers planned from their packed
    tensors."""
    from safetensors import safe_open

    config = quantization_config(path)
    _check(path, quantization, config)
    raw = json.loads((path / llama.CONFIG_FILE).read_text())
    shape = llama.LlamaShape.parse(raw, quantized=True)
    files = llama.weight_files(path)
    if shape is None or not files:
        raise ValueError(
            f"{path}: only plain Llama checkpoints in safetensors are served as {quantization}"
        )
    model = llama.LlamaForCausalLM(shape, llama.GenerationDefaults.read(path))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    embedding = model.model.embed_tokens
    tied = shape.tie_word_embeddings and "lm_head.weight" not in tensors
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                head_of_tied = tied and module is model.lm_head
                layout = _linear(path, quantization, config, tensors, name, head_of_tied)
                if (layout.out_features, layout.in_features) != (
                    module.out_features,
                    module.in_features,
                ):
                    raise ValueError(f"{name} is {layout.out_features}x{layout.in_features}")
                plan = loaded_plan(layout, tensors.pop(f"{name}.bias", None))
                apply_plan(module, plan, embedding if head_of_tied else None)
        rest = {k: v.float() for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
        if tied:
            rest.pop("model.embed_tokens.weight", None)
        missing, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    planned = {n for n, m in model.named_modules() if applied_plan(m) is not None}
    if tied:
        planned.add("model.embed_tokens")
    missing = [k for k in missing if k.rsplit(".", 1)[0] not in planned]
    if missing or unexpected:
        raise ValueError(
            f"{path} does not hold a Llama checkpoint's weights: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
    return model.eval()


def _linear(
    path: Path,
    quantization: str,
    config: dict,
    tensors: dict[str, torch.Tensor],
    name: str,
    head_of_tied: bool,
) -> "int4.Int4Weight | q8_weight.Q8Weight":
    """Layer ``name``'s weight: its packed 4-bit tensors, or, unquantized in the checkpoint
    (the head, the embedding's table where tied), int8 blocks."""
    if f"{name}.qweight" in tensors:
        return _layout(quantization, config, tensors, name)
    source = "model.embed_tokens.weight" if head_of_tied else f"{name}.weight"
    weight = tensors.get(source)
    if weight is None:
        raise ValueError(f"{path} has no weights for {name}")
    tensors.pop(f"{name}.weight", None)
    return q8_weight.quantize(weight.float())
