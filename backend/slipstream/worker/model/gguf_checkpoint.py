"""A GGUF checkpoint served as it ships (``quantization=gguf``): its Q4_0 / Q4_1 / Q4_K and Q8_0
blocks become the CPU kernels' layouts directly (``layers/quantization/gguf``), without the
float32 conversion the default path makes (``model/gguf``).

The model is ``model/llama``'s module tree (the lean forward runs it) built from the file's
metadata; every linear layer gets its plan from its tensor's blocks. llama.cpp stores the q and
k projections with each head's rotary halves interleaved (its conversion script permutes
their rows): the rows are put back in Hugging Face's order, a reordering of whole rows of
blocks. Tensors of another type (F32 / F16 / BF16 linears, Q5 / Q6_K ...) are dequantized
one at a time and held as int8 blocks (Q8_0's scheme), logged; norms stay float32.

The tokenizer is read from the file once (transformers' GGUF reader takes ~15 s) and kept in
the cache directory beside the file's name; for the embedded model, the converted directory's
tokenizer is the same and is used when present.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from slipstream.cache_dir import cache_root
from slipstream.worker.layers.quantization import gguf as gguf_blocks, int8 as q8_weight
from slipstream.worker.layers.reduced_linear import apply_plan, loaded_plan, read_rows_from
from slipstream.worker.model import llama

log = logging.getLogger("slipstream")

SUFFIX = ".gguf"
ARCHITECTURES = ("llama",)
_tokenizer_lock = threading.Lock()

# GGUF name (after "blk.N.") -> the Hugging Face module under model.layers[N]
_LAYER_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == SUFFIX


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_shape(reader: Any) -> llama.LlamaShape:
    """The model's shape from the file's metadata (llama architecture only)."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not served as it ships (only {ARCHITECTURES})"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    names = {t.name for t in reader.tensors}
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else 0)
    if not vocab:
        raise ValueError("the GGUF file names no vocabulary size")
    head_dim = int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads))
    return llama.LlamaShape(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=_field(reader, f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=any(n.endswith("attn_q.bias") for n in names),
        mlp_bias=any(n.endswith("ffn_up.bias") for n in names),
    )


def interleaved_rows(n: int, heads: int) -> torch.Tensor:
    """The file's row of each Hugging Face row of a q or k projection: llama.cpp's
    conversion stores each head's two rotary halves interleaved, row pairs (i, i + D/2)."""
    half = n // heads // 2
    return torch.arange(n).view(heads, half, 2).transpose(1, 2).reshape(-1)


def _dims(tensor: Any) -> tuple[int, int]:
    """``[N, K]`` of a 2-D tensor (ggml lists the innermost dimension first)."""
    k, n = (int(x) for x in tensor.shape)
    return n, k


def _layout(tensor: Any, rows: Optional[torch.Tensor] = None) -> gguf_blocks.Layout:
    """The tensor's blocks in a kernel's layout; a type the kernels do not read is dequantized
    (``gguf``'s own reader) and quantized to int8 blocks."""
    n, k = _dims(tensor)
    type_name = tensor.tensor_type.name
    layout = gguf_blocks.read(tensor.data, type_name, n, k, rows)
    if layout is not None:
        return layout
    from gguf.quants import dequantize

    log.info("GGUF %s is %s: held as int8 blocks", tensor.name, type_name)
    values = torch.from_numpy(np.asarray(dequantize(tensor.data, tensor.tensor_type)))
    values = values.reshape(n, k).float()
    if rows is not None:
        values = values[rows]
    return q8_weight.quantize(values)


def _vector(tensor: Any) -> torch.Tensor:
    from gguf.quants import dequantize

    return torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type))).float()


def load(path: Path) -> llama.LlamaForCausalLM:
    """The GGUF checkpoint at ``path``, its linear layers planned from its blocks."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    shape = read_shape(reader)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    model = llama.LlamaForCausalLM(shape, llama.GenerationDefaults(eos_token_id=eos))
    tensors = {t.name: t for t in reader.tensors}
    with torch.no_grad():
        _load_layers(model, shape, tensors)
        _load_ends(model, shape, tensors)
    unread = sorted(n for n in tensors if not n.startswith("blk.") and n not in _END_NAMES)
    if unread:
        raise ValueError(f"{path.name} holds tensors this loader does not place: {unread[:4]}")
    del reader, tensors  # the file's memory map goes
    return model.eval()


_END_NAMES = ("token_embd.weight", "output.weight", "output_norm.weight")


def _take(tensors: dict, name: str) -> Any:
    tensor = tensors.get(name)
    if tensor is None:
        raise ValueError(f"the GGUF file has no tensor {name!r}")
    return tensor


def _load_layers(model: llama.LlamaForCausalLM, shape: llama.LlamaShape, tensors: dict) -> None:
    for i, layer in enumerate(model.model.layers):
        for name, target in _LAYER_NORMS.items():
            norm = layer.get_submodule(target)
            norm.weight = torch.nn.Parameter(_vector(_take(tensors, f"blk.{i}.{name}.weight")))
        for name, target in _LAYER_LINEARS.items():
            module: Any = layer.get_submodule(target)  # a Linear
            rows = None
            if name in ("attn_q", "attn_k"):
                heads = shape.num_attention_heads if name == "attn_q" else shape.num_key_value_heads
                rows = interleaved_rows(module.out_features, heads)
            layout = _layout(_take(tensors, f"blk.{i}.{name}.weight"), rows)
            bias_tensor = tensors.get(f"blk.{i}.{name}.bias")
            bias = None if bias_tensor is None else _vector(bias_tensor)
            if bias is not None and rows is not None:
                bias = bias[rows]
            if (layout.out_features, layout.in_features) != (
                module.out_features,
                module.in_features,
            ):
                raise ValueError(f"blk.{i}.{name} is {layout.out_features}x{layout.in_features}")
            apply_plan(module, loaded_plan(layout, bias))


def _load_ends(model: llama.LlamaForCausalLM, shape: llama.LlamaShape, tensors: dict) -> None:
    model.model.norm.weight = torch.nn.Parameter(_vector(_take(tensors, "output_norm.weight")))
    embedding = model.model.embed_tokens
    table = _layout(_take(tensors, "token_embd.weight"))
    if shape.tie_word_embeddings:
        apply_plan(model.lm_head, loaded_plan(table), embedding=embedding)
        return
    apply_plan(model.lm_head, loaded_plan(_layout(_take(tensors, "output.weight"))))
    read_rows_from(embedding, loaded_plan(table))  # an input embedding of its own


def tokenizer_dir(path: Path) -> Path:
    """A directory with the file's tokenizer, written once (for the embedded model, the
    converted directory's, when it is there)."""
    from slipstream.worker.model.gguf import DEFAULT_GGUF_FILE, converted_dir

    converted = converted_dir()
    if path.name == DEFAULT_GGUF_FILE and (converted / ".complete").exists():
        return converted
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_root() / "gguf-tokenizers" / f"{path.stem}-{key.hexdigest()[:12]}"
    if (target / "tokenizer.json").exists():
        return target
    with _tokenizer_lock:
        if not (target / "tokenizer.json").exists():
            from transformers import AutoTokenizer

            log.info("reading the tokenizer of %s (once)", path.name)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            tmp = target.with_name(target.name + f".tmp{os.getpid()}")
            tokenizer.save_pretrained(tmp)
            tmp.rename(target)
    return target
