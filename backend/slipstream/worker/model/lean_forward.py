"""A lean forward for Llama-style decoder stacks on CPU (Llama, Mistral, Qwen2: SmolLM2 is one).

The Hugging Face forward spends, per layer, ~60 tensor ops and a dozen module calls through
transformers' wrappers (output capturing, kwargs plumbing, the attention-interface lookup,
gradient-checkpointing layers); on the 2-core CPU that Python and dispatch overhead was ~10 ms
of a ~40 ms batch-8 decode step. This runs the same modules' weights through the same
arithmetic in one flat loop: the same Linear weights in the same library (q, k, v and gate,
up each as one GEMM where that is bit-identical: one call and one read of the input instead
of three and two; vLLM fuses them the same way), the model's own embedding and rotary modules,
the rotary formula and residual order of
``modeling_llama``, ``F.rms_norm`` where it is bit-identical to the model's RMSNorm (checked
once per model; the module itself otherwise), the rotary formula in one compiled pass that
rounds as torch's operators do (``kernels/csrc/cpu_rotary.cpp``, fp32 with the CPU kernels loaded),
and the paged attention operators. Logits are the Hugging Face forward's, bit for bit, where
the norm check passes.

Models whose structure differs from this (other norms, activations, attention variants)
keep the Hugging Face forward; ``FastForward.for_model`` returns None for them.

A model split over tensor-parallel ranks (``distributed/sharding``) runs here on the rank's
shapes: the sums over the ranks after o and down, the embedding's and the LM head's
collectives are those modules' hooks, which this loop's module calls run. The compiled decode
stack calls the layers' products itself, without them: a sharded model does not use it.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from slipstream.worker import kernels
from slipstream.worker.distributed.sharding import shard_of
from slipstream.worker.layers.linear import CpuLinear, applied_mode, fused_linear
from slipstream.worker.layers.norm import LLAMA_STYLE_NORMS
from slipstream.worker.layers.reduced_linear import (
    applied_plan,
    applied_plan_of,
    fused_reduced,
    keep_bf16_output,
)
from slipstream.worker.model.decode_stack import DecodeStack, StackLayer

# model_type -> how a layer finds its sliding window (None: no window)
_WINDOW: dict = {
    "llama": lambda config, attn: None,
    "mistral": lambda config, attn: getattr(config, "sliding_window", None),
    "qwen2": lambda config, attn: getattr(attn, "sliding_window", None),
}

Projection = Callable[[torch.Tensor], Sequence[torch.Tensor]]
# (hidden [T, H], cos [T, D], sin [T, D]) -> hidden after every decoder layer
Layers = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Linears whose product runs on a stacked copy of their weights (_fused_projection).
_STACKED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


@dataclass
class _Layer:
    index: int
    norm_in: Callable[[torch.Tensor], torch.Tensor]
    norm_post: Callable[[torch.Tensor], torch.Tensor]
    qkv: Projection  # -> (q, k, v)
    o: torch.nn.Module
    gate_up: Projection  # -> (gate, up)
    down: torch.nn.Module
    # x -> silu(gate) * up in one pass, where the products are bf16 (else None)
    activation: Optional[Callable[[torch.Tensor], torch.Tensor]]
    scaling: float
    sliding_window: Optional[int]


# First module of a fused group -> its projection: a model shared by two runners (a draft
# model that is the target) is fused once.
_PROJECTIONS: "weakref.WeakKeyDictionary[torch.nn.Module, Projection]" = weakref.WeakKeyDictionary()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _torch_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """``modeling_llama``'s formula: x ``[T, heads*D]``, cos/sin ``[T, D]`` -> ``[T, heads, D]``."""
    x = x.reshape(x.shape[0], -1, head_dim)
    return (x * cos[:, None, :]) + (_rotate_half(x) * sin[:, None, :])


def _kernel_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """The same in one compiled pass (``kernels/csrc/cpu_rotary.cpp``), bit for bit."""
    out = torch.ops.slipstream_cpu.rotary(x, cos, sin, head_dim)
    return out.view(x.shape[0], -1, head_dim)


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The activations' dtype: the final norm's (the linears' weights may be bf16 or int8,
    layers/reduced_linear, with fp32 activations)."""
    hf: Any = model  # a transformers model: torch types its attributes as Tensor | Module
    return hf.model.norm.weight.dtype


def _rotary_for(model: torch.nn.Module) -> Callable:
    if _compute_dtype(model) == torch.float32 and kernels.load():
        return _kernel_rotary
    return _torch_rotary


def _fused_norm(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``F.rms_norm`` when it reproduces ``module`` bit for bit, else the module itself."""
    norm: Any = module  # an RMS norm (LLAMA_STYLE_NORMS): its weight and variance_epsilon
    weight, eps = norm.weight, norm.variance_epsilon
    shape = (weight.shape[0],)

    def fused(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, shape, weight, eps)

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows in (1, 3, 8, 33):
            x = torch.randn(1, rows, shape[0], generator=gen, dtype=weight.dtype) * 3
            if not torch.equal(fused(x), module(x)):
                return module
    return fused


class _Split:
    """A fused reduced product split back per layer; ``product`` gives it unsplit."""

    def __init__(self, product: Callable[[torch.Tensor], torch.Tensor], sizes: list[int]):
        self.product, self.sizes = product, sizes

    def __call__(self, x: torch.Tensor) -> Sequence[torch.Tensor]:
        return self.product(x).split(self.sizes, dim=-1)


def _gated_activation(gate_up: Projection) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """``silu(gate) * up`` in one compiled pass over the unsplit product, where that product
    is reduced: bf16 out of a bf16 product (its consumers take bf16), fp32 out of an int8 one
    (torch's silu_ and mul were two passes over a [T, 1536] product: ~6% of an int8 prompt
    step). Elsewhere None, and the model's own operators run (fp32 stays bit for bit the
    Hugging Face forward's)."""
    if not isinstance(gate_up, _Split) or not kernels.load():
        return None
    plan = applied_plan_of(gate_up.product)
    if plan is None or not (plan.bf16_out or plan.q8 is not None or plan.q4 is not None):
        return None
    product = gate_up.product
    return lambda x: torch.ops.slipstream_cpu.silu_mul(product(x))


def _separate_projection(modules: Sequence[torch.nn.Module]) -> Projection:
    return lambda x: tuple(m(x) for m in modules)


def _fused_projection(modules: Sequence[torch.nn.Linear], bf16_out: bool = True) -> Projection:
    """One GEMM for linears that share their input, split back per layer, when that gives
    each layer's output bit for bit (checked once); else the layers one by one. The fused
    copy replaces the layers' own packed weights (their stock ``.weight`` stays)."""
    if modules[0] in _PROJECTIONS:
        return _PROJECTIONS[modules[0]]

    reduced = fused_reduced(modules, bf16_out=bf16_out)
    if reduced is not None:  # each output column is its own dot product: no check needed
        projection = _Split(reduced, [m.out_features for m in modules])
        _PROJECTIONS[modules[0]] = projection
        return projection
    separate = _separate_projection(modules)
    modes = {applied_mode(m) for m in modules}
    if len(modes) != 1 or None in modes or any(not isinstance(m, torch.nn.Linear) for m in modules):
        return separate
    mode = modes.pop()
    assert mode is not None  # excluded above
    gemm, sizes = fused_linear(modules, mode), [m.out_features for m in modules]

    def fused(x: torch.Tensor) -> Sequence[torch.Tensor]:
        return gemm(x).split(sizes, dim=-1)

    gen = torch.Generator().manual_seed(0)
    weight = modules[0].weight
    with torch.no_grad():
        for rows in (1, 3, 8, 33):
            x = torch.randn(1, rows, weight.shape[1], generator=gen, dtype=weight.dtype)
            if not all(torch.equal(a, b) for a, b in zip(fused(x), separate(x))):
                return separate
    for m in modules:
        m.__dict__.pop("forward", None)  # frees the layer's own packed weight
        _STACKED.add(m)
    _PROJECTIONS[modules[0]] = fused
    return fused


class FastForward:
    """``logits(hidden_states(input_ids [T], positions [T], keep, attention_step))`` ->
    ``[len(keep), vocab]``, the step's attention given by ``attention_step``."""

    def __init__(self, model: torch.nn.Module, layers: list, select_early: bool = True) -> None:
        hf: Any = model  # a transformers model: torch types its attributes as Tensor | Module
        self.model = hf
        # The last layer's o-projection and MLP for the logits' rows only (else all rows).
        self.select_early = select_early
        self.base = self.model.model
        self.layers = layers
        self.num_heads = self.model.config.num_attention_heads
        self.num_kv_heads = self.model.config.num_key_value_heads
        self.head_dim = layers[0].o.in_features // self.num_heads
        self.final_norm = _fused_norm(self.base.norm)
        self.rotary = _rotary_for(model)
        # every layer in one compiled call on decode steps (set by for_model where it can)
        self.stack: Optional[DecodeStack] = None

    @classmethod
    def for_model(cls, model: torch.nn.Module, fuse: bool = True) -> Optional["FastForward"]:
        """The lean forward for ``model`` when its structure is the one this reproduces;
        ``fuse=False`` keeps every projection its own module call (LoRA wraps them) and every
        row through the last layer (the adapters find their rows by position)."""
        config = getattr(model, "config", None)
        window_of = _WINDOW.get(getattr(config, "model_type", None))
        base = getattr(model, "model", None)
        if window_of is None or base is None or not _is_plain_llama(model, config):
            return None
        project = _fused_projection if fuse else _separate_projection
        # q and k go through rotary in fp32 and v into the cache: a bf16 product hands them
        # out in fp32 (rounded once, on the cache store) rather than in bf16 widened again
        # (two copies a layer)
        project_qkv = functools.partial(_fused_projection, bf16_out=False) if fuse else project
        layers = []
        for i, layer in enumerate(base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            gate_up = project((mlp.gate_proj, mlp.up_proj))
            layers.append(
                _Layer(
                    i,
                    _fused_norm(layer.input_layernorm),
                    _fused_norm(layer.post_attention_layernorm),
                    project_qkv((attn.q_proj, attn.k_proj, attn.v_proj)),
                    attn.o_proj,
                    gate_up,
                    mlp.down_proj,
                    _gated_activation(gate_up),
                    attn.scaling,
                    window_of(config, attn),
                )
            )
        if fuse:  # bf16 products feed bf16 consumers as they are (vLLM's bf16 MLP)
            for layer in layers:
                keep_bf16_output(layer.o)
                keep_bf16_output(layer.down)
        forward = cls(model, layers, select_early=fuse)
        if fuse and shard_of(model) is None:  # the stack has no collectives (see the module)
            forward.stack = forward._decode_stack()
        return forward

    def _decode_stack(self) -> Optional[DecodeStack]:
        """The compiled stack of these layers, where each is one it runs as this loop does."""
        if self.rotary is not _kernel_rotary:
            return None
        stacked = [_stack_layer(layer) for layer in self.layers]
        if any(s is None for s in stacked):
            return None
        return DecodeStack.build(
            [s for s in stacked if s is not None], self.num_heads, self.num_kv_heads, self.head_dim
        )

    def packed_only(self) -> list[torch.nn.Linear]:
        """The fp32 linears whose products this forward runs on packed copies alone (their
        layers stacked, or packed by ``prepare_linears``): their stock weights are read by
        nothing. None of them when the projections are the modules' own (LoRA)."""
        if not self.select_early:  # fuse=False: LoRA wraps the modules' own products
            return []
        linears = [m for m in self.model.modules() if isinstance(m, torch.nn.Linear)]
        packed = (CpuLinear.ONEDNN, CpuLinear.AUTO)
        return [m for m in linears if m in _STACKED or applied_mode(m) in packed]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over ``hidden_states``' output: ``[len(keep), vocab]``."""
        return self.model.lm_head(hidden)[0]

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        keep: torch.Tensor,
        attention_step: Callable,
        stacked: Optional[Layers] = None,
    ) -> torch.Tensor:
        """The last layer's output after the final norm for the ``keep`` rows,
        ``[1, len(keep), hidden]``: what the LM head reads (``logits``; a pooling request's
        output). ``attention_step(layer_index, q [T,H,D], k [T,Hkv,D], v, scaling, window)``
        stores K/V and returns the attention output ``[T, H, D]``; ``stacked``, where given,
        runs every layer instead (the compiled stack over a decode step's caches), when
        every row's logits are kept."""
        t = input_ids.shape[0]
        hidden = self.base.embed_tokens(input_ids[None])  # [1, T, hidden]
        cos, sin = self.base.rotary_emb(hidden, positions[None])  # [1, T, D] each
        cos, sin = cos[0], sin[0]
        rows: Optional[torch.Tensor] = keep  # the rows still to select (None: selected)
        if stacked is not None and keep.numel() == t:
            hidden = stacked(hidden[0], cos, sin)[None]
        else:
            hidden, rows = self._layers(hidden, cos, sin, keep, attention_step)
        return self.final_norm(hidden if rows is None else hidden[:, rows, :])

    def _layers(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keep: torch.Tensor,
        attention_step: Callable,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Every decoder layer from Python: (hidden, the rows still to select or None)."""
        t = hidden.shape[1]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        rows: Optional[torch.Tensor] = keep
        for layer in self.layers:
            x = layer.norm_in(hidden)
            q, k, v = layer.qkv(x)  # fp32 (bf16 from oneDNN's AMX product: rotary is fp32)
            q = self.rotary(q[0].float(), cos, sin, d)
            k = self.rotary(k[0].float(), cos, sin, d)
            out = attention_step(
                layer.index, q, k, v.reshape(t, hkv, d), layer.scaling, layer.sliding_window
            )
            if self.select_early and layer is self.layers[-1] and keep.numel() < t:
                # The rest of the last layer feeds only the logits: the other rows' K/V are
                # stored, so their o-projection and MLP would be thrown away (a 2,048-token
                # prefill step with 13 sampled rows: ~1/36 of its GEMM work).
                out, hidden, t, rows = out[keep], hidden[:, keep], keep.numel(), None
            # In place where the operands are this step's own temporaries: the same
            # arithmetic without a fresh [T, width] buffer per operator (page faults at
            # prefill sizes).
            hidden.add_(layer.o(out.reshape(1, t, h * d)))
            x = layer.norm_post(hidden)
            if layer.activation is not None:
                hidden.add_(layer.down(layer.activation(x)))
            else:
                gate, up = layer.gate_up(x)
                hidden.add_(layer.down(torch.mul(F.silu(gate, inplace=True), up)))
        return hidden, rows


def _stack_layer(layer: _Layer) -> Optional[StackLayer]:
    """``layer`` in the compiled stack's terms, where its projections are fused reduced
    products and its activation the compiled one."""
    if not (isinstance(layer.qkv, _Split) and isinstance(layer.gate_up, _Split)):
        return None
    if layer.activation is None:
        return None
    qkv, gate_up = applied_plan_of(layer.qkv.product), applied_plan_of(layer.gate_up.product)
    o, down = applied_plan(layer.o), applied_plan(layer.down)
    if qkv is None or gate_up is None or o is None or down is None:
        return None
    norm_in, norm_post = layer.norm_in, layer.norm_post
    if not (isinstance(norm_in, torch.nn.Module) and isinstance(norm_post, torch.nn.Module)):
        return None
    return StackLayer(
        norm_in,
        norm_post,
        qkv,
        layer.qkv.sizes,
        o,
        gate_up,
        down,
        layer.scaling,
        layer.sliding_window,
    )


def _is_plain_llama(model: torch.nn.Module, config) -> bool:
    """The modules and settings the lean forward reproduces, and nothing else."""
    hf: Any = model  # a transformers model: torch types its attributes as Tensor | Module
    base = hf.model
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return False
    if not all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    if type(base.norm).__name__ not in LLAMA_STYLE_NORMS or not hasattr(model, "lm_head"):
        return False
    if _compute_dtype(model) != torch.float32:
        return False
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            return False
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return False
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return False
        if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            return False
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(norm).__name__ not in LLAMA_STYLE_NORMS:
                return False
    return True
