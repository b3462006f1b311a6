"""One rank's share of a loaded fp32 model: its weights cut down in place, and the collectives
that make its partial results whole.

Done on the checkpoint as loaded, before the CPU layers are prepared: every format (fp32,
bf16, int8) and both forwards (the lean one and transformers') then run unchanged on the
rank's smaller shapes. Per decoder layer, as in Megatron-LM and vLLM:

* q, k, v and gate, up are column-parallel: each rank keeps the output rows of its heads
  (``partition.head_shards``) and of its slice of the MLP, biases alike;
* o and down are row-parallel: each rank keeps the matching input columns, and their outputs
  are summed over the ranks (one all-reduce after attention, one after the MLP); a bias is
  kept by rank 0 alone, so that it is added once;
* the embedding and the LM head are vocabulary-parallel: each rank holds a share of the rows
  (one share where they are tied); a rank looks up the token ids it holds (zeros for the
  others) and the lookups are summed; the head's logits are gathered to rank 0, which
  samples from the whole vocabulary.

The collectives are forward hooks on those modules, so whatever calls the modules (the lean
forward, transformers' forward, int8's calibration pass) runs them, on every rank in the same
order. Nothing at load may call o, down, the embedding or the head on one rank only. The
compiled decode stack runs its layers without calling the modules: a sharded model runs the
Python loop instead (``lean_forward.FastForward.for_model``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from slipstream.worker.distributed.partition import (
    HeadShard,
    Span,
    VocabShard,
    even_spans,
    head_shards,
    vocab_shards,
)

# model_type of the architectures whose layers are split here (their modules are named as
# Llama's; the tests run each of them against the unsplit model).
SHARDED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
SHARD_ATTRIBUTE = "tensor_parallel_shard"


class Collectives(Protocol):
    """What the hooks ask of the group (``process_group.RankGroup``)."""

    rank: int
    world: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def gather_to_first(self, tensor: torch.Tensor) -> Optional[list[torch.Tensor]]: ...


@dataclass(frozen=True)
class ShardInfo:
    """What one rank holds of the model."""

    rank: int
    world: int
    heads: HeadShard
    intermediate: Span
    vocab: VocabShard
    vocab_size: int  # the whole vocabulary (the gathered logits' width)


def shard_of(model: torch.nn.Module) -> Optional[ShardInfo]:
    """The rank's share where ``model`` is sharded, else None."""
    return getattr(model, SHARD_ATTRIBUTE, None)


def check_shardable(model: torch.nn.Module, world: int) -> None:
    """``ValueError`` naming why ``model`` cannot be split over ``world`` ranks."""
    hf: Any = model  # a transformers model (or model/llama's): torch types attributes loosely
    text = hf.config.get_text_config()
    model_type = getattr(text, "model_type", None)
    if model_type not in SHARDED_MODEL_TYPES:
        raise ValueError(
            f"tensor_parallel_size={world}: a {model_type!r} model cannot be split over ranks "
            f"(supported: {', '.join(SHARDED_MODEL_TYPES)})"
        )
    base = getattr(hf, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not hasattr(hf, "lm_head") or not hasattr(base, "embed_tokens"):
        raise ValueError(f"tensor_parallel_size={world}: the model's modules are not Llama's")
    for layer in layers:
        modules = [getattr(layer.self_attn, n, None) for n in _ATTENTION]
        modules += [getattr(layer.mlp, n, None) for n in _MLP]
        if not all(isinstance(m, torch.nn.Linear) for m in modules):
            raise ValueError(
                f"tensor_parallel_size={world}: layer {layer.self_attn.layer_idx} does not "
                "hold plain q/k/v/o and gate/up/down linear layers"
            )
    kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_shards(text.num_attention_heads, kv, world)  # raises where the heads cannot split


def shard_model(model: torch.nn.Module, group: Collectives) -> ShardInfo:
    """Cut ``model`` (fp32, as loaded) down to ``group.rank``'s share and hook its
    collectives in (see the module). Returns the share, also kept on the model."""
    check_shardable(model, group.world)
    hf: Any = model
    text = hf.config.get_text_config()
    heads_total = text.num_attention_heads
    kv_total = getattr(text, "num_key_value_heads", None) or heads_total
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads_total
    rank, world = group.rank, group.world
    info = ShardInfo(
        rank,
        world,
        head_shards(heads_total, kv_total, world)[rank],
        even_spans(text.intermediate_size, world)[rank],
        vocab_shards(text.vocab_size, world)[rank],
        text.vocab_size,
    )
    for layer in hf.model.layers:
        _shard_layer(layer, info, head_dim, group)
    _shard_vocabulary(hf, info, group)
    _shard_config(hf, info, head_dim)
    setattr(model, SHARD_ATTRIBUTE, info)
    return info


# -- weights -------------------------------------------------------------------------------
def _keep_rows(linear: torch.nn.Linear, rows: Span) -> None:
    """Column-parallel: this rank's output rows (and bias)."""
    with torch.no_grad():
        linear.weight = torch.nn.Parameter(
            linear.weight[rows.start : rows.stop].clone(), requires_grad=False
        )
        if linear.bias is not None:
            linear.bias = torch.nn.Parameter(
                linear.bias[rows.start : rows.stop].clone(), requires_grad=False
            )
    linear.out_features = rows.size


def _keep_columns(linear: torch.nn.Linear, columns: Span, keeps_bias: bool) -> None:
    """Row-parallel: this rank's input columns; the bias only on the rank that adds it."""
    with torch.no_grad():
        linear.weight = torch.nn.Parameter(
            linear.weight[:, columns.start : columns.stop].clone(), requires_grad=False
        )
        if linear.bias is not None and not keeps_bias:
            linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = columns.size


def _shard_layer(layer: Any, info: ShardInfo, head_dim: int, group: Collectives) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    query, kv = info.heads.query.scaled(head_dim), info.heads.kv.scaled(head_dim)
    _keep_rows(attn.q_proj, query)
    _keep_rows(attn.k_proj, kv)
    _keep_rows(attn.v_proj, kv)
    _keep_columns(attn.o_proj, query, keeps_bias=info.rank == 0)
    _keep_rows(mlp.gate_proj, info.intermediate)
    _keep_rows(mlp.up_proj, info.intermediate)
    _keep_columns(mlp.down_proj, info.intermediate, keeps_bias=info.rank == 0)
    if hasattr(attn, "num_key_value_groups"):  # transformers' eager / sdpa attention read it
        attn.num_key_value_groups = info.heads.group_size
    reduce = _SumOverRanks(group)
    attn.o_proj.register_forward_hook(reduce)
    mlp.down_proj.register_forward_hook(reduce)


def _vocab_rows(weight: torch.Tensor, shard: VocabShard) -> torch.nn.Parameter:
    """This rank's rows of a vocabulary table, zero-padded to the shard's size."""
    rows = torch.zeros(shard.padded, weight.shape[1], dtype=weight.dtype, device=weight.device)
    rows[: shard.rows.size] = weight[shard.rows.start : shard.rows.stop]
    return torch.nn.Parameter(rows, requires_grad=False)


def _shard_vocabulary(hf: Any, info: ShardInfo, group: Collectives) -> None:
    embedding, head = hf.model.embed_tokens, hf.lm_head
    tied = head.weight is embedding.weight
    with torch.no_grad():
        embedding.weight = _vocab_rows(embedding.weight, info.vocab)
        head.weight = embedding.weight if tied else _vocab_rows(head.weight, info.vocab)
    if head.bias is not None:
        raise ValueError("tensor parallelism: an LM head with a bias is not split")
    embedding.num_embeddings = head.out_features = info.vocab.padded
    pad, rows = embedding.padding_idx, info.vocab.rows
    held = pad is not None and rows.start <= pad < rows.stop
    embedding.padding_idx = pad - rows.start if held else None
    lookup = _VocabLookup(group, rows)
    embedding.register_forward_pre_hook(lookup.local_ids)
    embedding.register_forward_hook(lookup.summed)
    head.register_forward_hook(_GatheredLogits(group, info.vocab_size))


def _shard_config(hf: Any, info: ShardInfo, head_dim: int) -> None:
    """The model's config says the rank's heads (the KV cache, the attention plan and the
    lean forward read them); the vocabulary stays the whole one. A transformers config is
    changed in place: its attention modules hold it (``_attn_implementation``)."""
    text = hf.config.get_text_config()
    changes = dict(
        num_attention_heads=info.heads.query.size,
        num_key_value_heads=info.heads.kv.size,
        head_dim=head_dim,
    )
    if dataclasses.is_dataclass(text):  # model/llama's frozen shape
        hf.config = dataclasses.replace(text, **changes)  # type: ignore[type-var]
        return
    for name, value in changes.items():
        setattr(text, name, value)


# -- the collectives, as forward hooks -----------------------------------------------------
class _SumOverRanks:
    """Row-parallel output: the ranks' partial products summed."""

    def __init__(self, group: Collectives) -> None:
        self.group = group

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor):
        return self.group.all_reduce(output)


class _VocabLookup:
    """Vocabulary-parallel embedding: each rank looks up the ids it holds, zeros elsewhere,
    and the rows are summed (one rank holds each id)."""

    def __init__(self, group: Collectives, rows: Span) -> None:
        self.group, self.rows = group, rows
        self._held: Optional[torch.Tensor] = None  # the ids this rank holds, between hooks

    def local_ids(self, module: torch.nn.Module, args: tuple) -> tuple:
        ids = args[0]
        held = (ids >= self.rows.start) & (ids < self.rows.stop)
        self._held = held
        local = torch.where(held, ids - self.rows.start, torch.zeros_like(ids))
        return (local, *args[1:])

    def summed(self, module: torch.nn.Module, args: tuple, output: torch.Tensor):
        held, self._held = self._held, None
        assert held is not None, "the pre-hook runs before every lookup"
        return self.group.all_reduce(output.masked_fill(~held.unsqueeze(-1), 0))


class _GatheredLogits:
    """Vocabulary-parallel head: the ranks' logits side by side on rank 0, padding cut."""

    def __init__(self, group: Collectives, vocab_size: int) -> None:
        self.group, self.vocab_size = group, vocab_size

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor):
        parts = self.group.gather_to_first(output)
        if parts is None:  # not rank 0: its logits are not used
            return output
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]
