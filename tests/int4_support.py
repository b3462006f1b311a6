"""Tiny 4-bit checkpoints made here, each in its tool's own packing (AutoAWQ's GEMM, GPTQ's,
llama.cpp's GGUF blocks), with the weights they stand for in float64, and the float64
reference forward the engine's greedy tokens are checked against.

The packers follow the formats' specifications independently of the loaders under test
(``worker/layers/quantization/awq.py``, ``gptq.py``, ``gguf.py``). The models' embeddings are
drawn wide (std 0.5) so that their logits are far from ties: the reference multiplies the
activations in int8 blocks as the kernels do, in float64, and a near-tie could go either way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from support import tiny_model_dir

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ packs output column 8p + ORDER[i] at nibble i
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_config(hidden: int = 64, intermediate: int = 128, **overrides) -> dict:
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
    )
    config.update(overrides)
    return config


def random_state(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Float32 weights under Hugging Face's names (the embedding wide: peaked logits)."""
    gen = torch.Generator().manual_seed(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h)}
    shapes.update(gate_proj=(i, h), up_proj=(i, h), down_proj=(h, i))
    state = {"model.embed_tokens.weight": torch.randn(v, h, generator=gen) * 0.5}
    state["model.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        for name, shape in shapes.items():
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            fan_in = shape[1]
            state[f"{prefix}{part}.{name}.weight"] = (
                torch.randn(*shape, generator=gen) / fan_in**0.5
            )
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"{prefix}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    return state


def linear_names(config: dict) -> list[str]:
    out = []
    for layer in range(config["num_hidden_layers"]):
        for name in LINEARS:
            part = "self_attn" if name in LINEARS[:4] else "mlp"
            out.append(f"model.layers.{layer}.{part}.{name}")
    return out


def _asymmetric(w: torch.Tensor, group_of: torch.Tensor, groups: int, min_zero: int = 0):
    """4-bit codes with a float16 scale and an integer zero per output column and group
    (min/max): ``q`` [N, K], ``s`` float16 [N, G], ``z`` [N, G], and ``s * (q - z)`` float64."""
    n, k = w.shape
    s = torch.empty(n, groups, dtype=torch.float16)
    z = torch.empty(n, groups)
    q = torch.empty(n, k)
    for g in range(groups):
        cols = (group_of == g).nonzero().flatten()
        wg = w[:, cols]
        lo, hi = wg.amin(1), wg.amax(1)
        scale = ((hi - lo).clamp(min=1e-4) / 15).half()
        zero = torch.round(-lo / scale.float()).clamp(min_zero, 15)
        s[:, g], z[:, g] = scale, zero
        q[:, cols] = torch.clamp(torch.round(wg / scale.float()[:, None]) + zero[:, None], 0, 15)
    deq = (q.double() - z.double()[:, group_of]) * s.double()[:, group_of]
    return q.to(torch.int64), s, z.to(torch.int64), deq


def _pack_int32(values: torch.Tensor) -> torch.Tensor:
    """[..., 8] int64 nibbles (nibble i = values[..., i]) -> int32."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    word = (values << shifts).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def awq_tensors(w: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    """AutoAWQ's GEMM tensors of ``w`` [N, K] and the weight they stand for (float64)."""
    n, k = w.shape
    q, s, z, deq = _asymmetric(w, torch.arange(k) // group, k // group)
    order = torch.tensor(AWQ_ORDER)

    def pack(rows: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N/8], AWQ's column order
        return _pack_int32(rows.view(rows.shape[0], -1, 8)[:, :, order])

    tensors = {"qweight": pack(q.t()), "qzeros": pack(z.t()), "scales": s.t().contiguous()}
    return tensors, deq


def gptq_tensors(
    w: torch.Tensor, group: int, act_order: bool = False, v2: bool = False, seed: int = 0
) -> tuple[dict, torch.Tensor]:
    """GPTQ's tensors of ``w`` [N, K] (zeros stored less one unless ``v2``; ``act_order``:
    groups numbered out of channel order, as desc_act makes them) and the weight (float64)."""
    n, k = w.shape
    if act_order:
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // group
    else:
        g_idx = torch.arange(k) // group
    # v1 stores z - 1 as a nibble: a zero of 0 would wrap (GPTQ's own limitation)
    q, s, z, deq = _asymmetric(w, g_idx, k // group, min_zero=0 if v2 else 1)
    stored = z - (0 if v2 else 1)
    tensors = {
        "qweight": _pack_int32(q.t().reshape(k // 8, 8, n).permute(0, 2, 1)),
        "qzeros": _pack_int32(stored.t().reshape(k // group, n // 8, 8)),
        "scales": s.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, deq


def write_int4_dir(
    target: Path, scheme: str, group: int = 32, seed: int = 0, **options
) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny AWQ or GPTQ checkpoint at ``target`` and the float64 weights it stands for
    (every tensor the reference needs, under Hugging Face's names)."""

    config = tiny_config()
    state = random_state(config, seed)
    saved, reference = {}, {}
    for name in linear_names(config):
        w = state.pop(f"{name}.weight")
        if scheme == "awq":
            tensors, deq = awq_tensors(w, group)
        else:
            tensors, deq = gptq_tensors(w, group, seed=seed, **options)
        saved.update({f"{name}.{key}": value for key, value in tensors.items()})
        reference[f"{name}.weight"] = deq
    # unquantized in the checkpoint, as these tools leave them: float16
    saved.update({key: value.half() for key, value in state.items()})
    reference.update({key: value.half().double() for key, value in state.items()})
    # the engine holds the unquantized head (the tied embedding's table) as int8 blocks
    table = "model.embed_tokens.weight"
    reference[table] = q8_0_values(state[table].half().float())
    quant = {"quant_method": scheme, "bits": 4, "group_size": group}
    if scheme == "awq":
        quant.update(zero_point=True, version="gemm")
    else:
        quant.update(desc_act=bool(options.get("act_order")), sym=False)
        quant["checkpoint_format"] = "gptq_v2" if options.get("v2") else "gptq"
    config["quantization_config"] = quant
    _write_dir(target, config, saved)
    return target, reference


def q8_0_values(w: torch.Tensor) -> torch.Tensor:
    """``w`` in Q8_0's blocks (symmetric per 32, scale amax / 127, nearest ties to even, as
    int8's quantization computes it in float32), float64."""
    b = w.float().view(w.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(b * inv).clamp(-127, 127)
    return (q * (amax / 127.0)).double().view(w.shape)


def engine_outliers(engine) -> dict[str, torch.Tensor]:
    """The input channels each linear layer of a served int4 model multiplies apart (its
    plan's, a fused q/k/v or gate/up plan's for its layers), by module name."""
    from slipstream.worker.layers import reduced_linear as rl

    out = {}
    for name, module in engine.model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        plan = rl.serving_plan(module)
        assert plan is not None, name
        layout = plan.q4 if plan.q4 is not None else plan.q8
        assert layout is not None and layout.outliers is not None, name
        channels = layout.outliers
        perm = getattr(layout, "perm", None)
        out[name] = channels if perm is None else perm[channels]
    return out


def _write_dir(target: Path, config: dict, tensors: dict) -> None:
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(config))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(target / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir("llama") / name, target / name)


def interleave_rotary_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's conversion of a q or k projection: each head's rotary halves interleaved."""
    n = w.shape[0]
    return w.reshape(heads, 2, n // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q4_k_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """Random Q4_K blocks of a weight [N, K] (gguf-py quantizes no Q4_K: drawn directly)."""
    rng = np.random.default_rng(seed)
    sb = k // 256
    blocks = rng.integers(0, 256, size=(n, sb, 144), dtype=np.uint8)
    d = (rng.random((n, sb)) * 2e-4 + 5e-5).astype(np.float16)
    dmin = (rng.random((n, sb)) * 2e-4 + 5e-5).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(n, sb, 2)
    blocks[..., 2:4] = dmin.view(np.uint8).reshape(n, sb, 2)
    return blocks.reshape(n, sb * 144)


def write_gguf(
    path: Path, layer_type: str = "Q4_1", embed_type: str = "Q8_0", seed: int = 0
) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """A tiny llama GGUF (layers in ``layer_type``: Q4_0, Q4_1 or Q4_K; the tied embedding in
    ``embed_type``), the float64 weights it stands for (gguf-py's own dequantization) and its
    config."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    hidden = 256 if layer_type == "Q4_K" else 64
    config = tiny_config(hidden=hidden, intermediate=2 * hidden)
    state = random_state(config, seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_eos_token_id(2)
    reference: dict[str, torch.Tensor] = {}
    gguf_names = {
        "q_proj": "attn_q",
        "k_proj": "attn_k",
        "v_proj": "attn_v",
        "o_proj": "attn_output",
        "gate_proj": "ffn_gate",
        "up_proj": "ffn_up",
        "down_proj": "ffn_down",
    }

    def add(name: str, hf_name: str, w: torch.Tensor, type_name: str, heads: Optional[int]):
        qtype = GGMLQuantizationType[type_name]
        stored = interleave_rotary_rows(w, heads) if heads else w
        if type_name == "Q4_K":
            data = q4_k_blocks(*stored.shape, seed=len(reference))
        else:
            data = quantize(stored.numpy().astype(np.float32), qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        values = torch.from_numpy(dequantize(data, qtype).astype(np.float64)).reshape(w.shape)
        if heads:  # back to Hugging Face's row order
            rows = torch.arange(w.shape[0]).view(heads, 2, -1).transpose(1, 2).reshape(-1)
            values = values[torch.argsort(rows)]
        reference[hf_name] = values

    add(
        "token_embd.weight",
        "model.embed_tokens.weight",
        state["model.embed_tokens.weight"],
        embed_type,
        None,
    )
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for layer in range(config["num_hidden_layers"]):
        for hf, gg in gguf_names.items():
            part = "self_attn" if hf in LINEARS[:4] else "mlp"
            hf_name = f"model.layers.{layer}.{part}.{hf}.weight"
            add(f"blk.{layer}.{gg}.weight", hf_name, state[hf_name], layer_type, heads.get(hf))
        for hf, gg in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")):
            w = state[f"model.layers.{layer}.{hf}.weight"]
            writer.add_tensor(f"blk.{layer}.{gg}.weight", w.numpy())
            reference[f"model.layers.{layer}.{hf}.weight"] = w.double()
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    reference["model.norm.weight"] = state["model.norm.weight"].double()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, reference, config


def activation_blocks(x: torch.Tensor, outliers: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` [T, K] as the kernels multiply it: its float32 value in int8 blocks of 32, the
    outlier channels as they are (float64 out)."""
    x32 = x.float()
    kept = x32.clone()
    if outliers is not None and outliers.numel():
        kept[:, outliers] = 0
    b = kept.view(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(b * inv).clamp(-127, 127)
    out = (q.double() * (amax / 127).double()).view(x.shape)
    if outliers is not None and outliers.numel():
        out[:, outliers] = x32[:, outliers].double()
    return out


def reference_greedy(
    weights: dict[str, torch.Tensor],
    config: dict,
    outliers: dict[str, torch.Tensor],
    prompt: list[int],
    max_tokens: int,
) -> list[int]:
    """Greedy tokens of the float64 model with these weights, each linear layer multiplying
    its input in int8 blocks as the kernels do (``outliers``: layer name -> the channels it
    keeps apart)."""
    from slipstream.worker.model import llama

    shape = llama.LlamaShape.parse(config)
    assert shape is not None
    model = llama.LlamaForCausalLM(shape, llama.GenerationDefaults())
    state = dict(weights)
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict({k: v.double() for k, v in state.items()}, assign=True)
    model = model.double().eval()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            kept = outliers.get(name)
            module.forward = lambda x, m=module, o=kept: torch.nn.functional.linear(
                activation_blocks(x.reshape(-1, x.shape[-1]), o).view(x.shape), m.weight
            )
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]
