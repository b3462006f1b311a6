"""Which forward runs a step, chosen in one place: the model runner asks ``ModelForward``.

Three paths compute the same logits over the paged KV cache:

* ``TRANSFORMERS``: the model's own module tree, its attention routed to the paged cache
  through transformers' attention interface (``attention/transformers_hook``). Any model whose
  class supports that interface; the only path on CUDA.
* ``LEAN``: ``lean_forward``'s flat loop over a Llama-style stack's weights (CPU): the same
  arithmetic without transformers' per-layer Python. A model built by ``model/llama`` (no
  transformers module tree) runs this path only.
* ``DECODE_STACK``: every decoder layer in one compiled call (``decode_stack``), on CPU steps
  whose every row is a decode-kernel row, where the weights are int8 or bf16 panels.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from typing import Any, Callable, Iterator, Optional

import torch

from slipstream.worker.attention import transformers_hook
from slipstream.worker.attention.base import AttentionOps
from slipstream.worker.attention.layer import AttentionLayer
from slipstream.worker.attention.metadata import AttentionMetadata
from slipstream.worker.kv_cache import KVCache
from slipstream.worker.model import llama
from slipstream.worker.model.lean_forward import FastForward, Layers


class ForwardPath(str, enum.Enum):
    TRANSFORMERS = "transformers"
    LEAN = "lean"
    DECODE_STACK = "decode_stack"


def check_backend_compatible(model: torch.nn.Module) -> None:
    compatible = getattr(model, "is_backend_compatible", None)
    ok = (
        compatible()
        if callable(compatible)
        else getattr(model, "_supports_attention_backend", False)
    )
    if not ok:
        raise ValueError(
            f"{type(model).__name__} does not support transformers' attention interface, so its "
            "attention cannot run on the paged KV cache; choose a model whose class does "
            "(Llama, Qwen, Mistral, Gemma, Phi, GPT-NeoX, GPT-2, OPT, ...)"
        )


class ModelForward:
    """``__call__(input_ids [T], positions [T], meta, keep) -> logits [len(keep), V]``."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        ops: AttentionOps,
        lean: Optional[FastForward],
    ) -> None:
        self.model = model
        self.kv = kv
        self.ops = ops
        self.lean = lean
        hf: Any = model  # a transformers model: torch types its methods as Tensor | Module
        self.num_query_heads = hf.config.get_text_config().num_attention_heads

    @classmethod
    def select(
        cls,
        model: torch.nn.Module,
        kv: KVCache,
        ops: AttentionOps,
        device: torch.device,
        fast_forward: bool = True,
        fuse: bool = True,
    ) -> "ModelForward":
        """The forward for ``model`` on ``device``: the lean one on CPU where ``fast_forward``
        and the model's structure allow it, else transformers' with the attention hook.
        ``fuse=False`` (LoRA) keeps every projection its own module call."""
        lean_only = isinstance(model, llama.LlamaForCausalLM)
        if not lean_only:
            check_backend_compatible(model)
            hf: Any = model
            hf.set_attn_implementation(transformers_hook.register())
        lean = None
        if (fast_forward or lean_only) and device.type == "cpu":
            lean = FastForward.for_model(model, fuse=fuse)
        if lean_only and lean is None:
            raise ValueError("a model built by model/llama runs on CPU with the lean forward only")
        return cls(model, kv, ops, lean)

    def path_for(self, meta: AttentionMetadata, keeps_every_row: bool) -> ForwardPath:
        """The path a planned step takes."""
        if self.lean is None:
            return ForwardPath.TRANSFORMERS
        step = meta.plan.decode_step() if meta.plan is not None else None
        if self.lean.stack is not None and step is not None and keeps_every_row:
            return ForwardPath.DECODE_STACK
        return ForwardPath.LEAN

    def packed_only(self) -> list[torch.nn.Linear]:
        """The linears whose stock weights nothing reads (see ``FastForward.packed_only``)."""
        return self.lean.packed_only() if self.lean is not None else []

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        # Every layer shares the step's layout: the ops work it out once, here.
        meta.plan = self.ops.plan(meta, self.kv.key_caches[0], self.num_query_heads)
        path = self.path_for(meta, keep.numel() == input_ids.shape[0])
        if path is ForwardPath.TRANSFORMERS:
            with self._hooked(meta, self.kv) as model:
                out = model(
                    input_ids=input_ids[None],
                    position_ids=positions[None],
                    use_cache=False,
                    logits_to_keep=keep,
                )
            return out.logits[0]
        assert self.lean is not None  # path_for chose a lean path
        stacked = self._stacked(meta) if path is ForwardPath.DECODE_STACK else None
        hidden = self.lean.hidden_states(
            input_ids, positions, keep, self._attention_step(meta), stacked
        )
        return self.lean.logits(hidden)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCache,
    ) -> torch.Tensor:
        """The last layer's hidden states after the final norm, ``[T, hidden]``, over the KV
        cache ``kv`` (a pooling forward gives its prompt a cache of its own)."""
        meta.plan = self.ops.plan(meta, kv.key_caches[0], self.num_query_heads)
        every_row = torch.arange(input_ids.shape[0], device=input_ids.device)
        if self.lean is not None:
            return self.lean.hidden_states(
                input_ids, positions, every_row, self._attention_step(meta, kv)
            )[0]
        with self._hooked(meta, kv) as model:  # its base model returns the states
            out = model.model(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            )
        return out.last_hidden_state[0]

    @contextlib.contextmanager
    def _hooked(self, meta: AttentionMetadata, kv: KVCache) -> Iterator[Any]:
        """The transformers model (typed Any: torch types its methods as Tensor | Module),
        its attention layers reading and writing ``kv`` through the hook for this step."""
        context = transformers_hook.StepContext(meta, kv.key_caches, kv.value_caches, self.ops)
        with transformers_hook.step_context(context):
            yield self.model

    def _stacked(self, meta: AttentionMetadata) -> Layers:
        """The compiled decode stack over this step's caches and decode rows."""
        assert self.lean is not None and self.lean.stack is not None and meta.plan is not None
        step = meta.plan.decode_step()
        assert step is not None  # path_for checked it
        return functools.partial(
            self.lean.stack.run,
            key_caches=self.kv.key_caches,
            value_caches=self.kv.value_caches,
            rows=step,
        )

    def _attention_step(self, meta: AttentionMetadata, kv: Optional[KVCache] = None) -> Callable:
        """The lean forward's attention: store the new K/V, attend over the paged cache."""
        kv = kv or self.kv
        key_caches, value_caches, ops = kv.key_caches, kv.value_caches, self.ops

        def step(index: int, q, k, v, scaling: float, window) -> torch.Tensor:
            layer = AttentionLayer(key_caches[index], value_caches[index], scaling, window)
            ops.store_step_kv(k, v, layer, meta)
            return ops.paged_attention(q, layer, meta)

        return step
