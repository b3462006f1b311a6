"""Builds what runs a model: the model itself, its paged KV cache and the runner that packs
steps for it. The engine builds its target model here, and the draft-model proposer its
draft model, with the same device, dtype and runner rules."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from slipstream.core.config import EngineConfig
from slipstream.worker.device import DeviceSettings
from slipstream.worker.kv_cache import KVCache, KVGeometry, kv_budget_bytes, num_blocks_for_budget
from slipstream.worker.layers.linear import drop_stock_weights
from slipstream.worker.layers.memory import release_freed_memory
from slipstream.worker.layers.preparation import prepare_cpu_model
from slipstream.worker.layers.reduced_linear import WeightFormat
from slipstream.worker.lora.layers import LoraLayers, load_lora_layers
from slipstream.worker.model import loader
from slipstream.worker.model.context_length import fit_max_model_len
from slipstream.worker.model_runner import ModelRunner

log = logging.getLogger("slipstream")


def resolved_max_model_len(config: EngineConfig) -> int:
    """``max_model_len`` of a config fitted to its model (``ModelFactory.load_target``),
    where it is always set."""
    assert config.max_model_len is not None, "the config is not fitted to its model"
    return config.max_model_len


def input_vocab_size(model: torch.nn.Module) -> int:
    """How many token ids the model embeds (its input embeddings' rows)."""
    hf: Any = model  # a transformers model: torch types its methods as Tensor | Module
    return int(hf.get_input_embeddings().num_embeddings)


@dataclass
class TargetModel:
    """The served model as loaded, with the config fitted to it (``max_model_len``)."""

    model: torch.nn.Module
    tokenizer: Any  # a transformers tokenizer (or a test's stand-in), used by duck typing
    config: EngineConfig
    lora: Optional[LoraLayers]


@dataclass
class ModelStack:
    model: torch.nn.Module
    kv_cache: KVCache
    runner: ModelRunner


class ModelFactory:
    def __init__(self, config: EngineConfig, settings: DeviceSettings) -> None:
        self.config = config
        self.settings = settings

    # -- the target model --------------------------------------------------------------------
    def load_target(
        self, model: Optional[torch.nn.Module] = None, tokenizer: object = None
    ) -> TargetModel:
        """The served model (``model`` / ``tokenizer`` given: used as they are), its CPU
        layers packed and its LoRA adapters loaded."""
        s = self.settings
        path: Optional[Path] = None
        if model is None:
            path = loader.resolve_model_path(self.config.model, s.quantization)
            model = loader.load_model(
                path, s.dtype, s.device, lean=self.config.fast_forward, quantization=s.quantization
            )
        if tokenizer is None:
            tokenizer = loader.load_tokenizer(path, self.config.tokenizer)
        config = self.config = fit_max_model_len(self.config, model.config)
        if s.device.type == "cpu":
            prepare_cpu_model(model, s.weight_format, config.cpu_linear)
        lora = None
        if config.enable_lora:  # after packing: adapters wrap the packed linears
            lora = load_lora_layers(
                config.lora_modules, model, config.max_lora_rank, s.dtype, s.device
            )
        return TargetModel(model, tokenizer, config, lora)

    def allocate_kv_cache(self, model: torch.nn.Module) -> KVCache:
        """The target's cache: ``num_gpu_blocks_override`` blocks, or what the budget holds."""
        c = self.config
        geometry = KVGeometry.from_model_config(model.config, c.block_size, self.settings.kv_dtype)
        if c.num_gpu_blocks_override is not None:
            num_blocks = c.num_gpu_blocks_override + 1  # + the scratch block
        else:
            budget = kv_budget_bytes(
                c.kv_cache_memory_bytes, c.gpu_memory_utilization, self.settings.device
            )
            num_blocks = num_blocks_for_budget(geometry, budget)
        if num_blocks < 2:
            raise ValueError(
                f"KV budget holds {num_blocks} blocks of {geometry.bytes_per_block} bytes; raise "
                "kv_cache_memory_bytes"
            )
        log.info(
            "KV cache: %d blocks x %d tokens, %.1f MiB (%d bytes/token)",
            num_blocks,
            geometry.block_size,
            num_blocks * geometry.bytes_per_block / 2**20,
            geometry.bytes_per_token,
        )
        return KVCache(geometry, num_blocks, self.settings.device)

    def build_runner(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        max_model_len: int,
        lora: Optional[LoraLayers] = None,
    ) -> ModelRunner:
        c = self.config
        runner = ModelRunner(
            model,
            kv_cache,
            self.settings.device,
            max_model_len,
            c.max_num_seqs,
            c.cuda_graph_batch_sizes if c.enable_cuda_graphs else None,
            c.attention_ops,
            c.fast_forward,
            lora,
        )
        if self.settings.device.type == "cpu":
            # fp32: the stock weights the packed copies replace
            drop_stock_weights(model, runner.forward.packed_only())
            # the lean forward stacks q, k, v and gate, up into one weight each: the layers'
            # own copies it freed go back to the OS (bf16: ~140 MB of heap otherwise kept)
            release_freed_memory()
        return runner

    # -- the draft model ---------------------------------------------------------------------
    def draft_stack(self, target: torch.nn.Module, target_num_blocks: int) -> ModelStack:
        """The draft-model proposer's model (the target's weights when they are the same
        model), on its own cache: room for everything the target cache can hold plus each
        sequence's drafts."""
        c, s = self.config, self.settings
        model = target
        if c.speculative_model != c.model or target is None:
            # the draft method requires speculative_model (EngineConfig's validation)
            assert c.speculative_model is not None
            path = loader.resolve_model_path(c.speculative_model)
            model = loader.load_model(path, s.dtype, s.device)
            if s.device.type == "cpu":  # the draft runs fp32 weights, whatever the target's
                prepare_cpu_model(model, WeightFormat.FLOAT32.value, c.cpu_linear)
        geometry = KVGeometry.from_model_config(model.config, c.block_size, s.dtype)
        per_seq = -(-(c.num_speculative_tokens + 1) // c.block_size) + 1
        num_blocks = target_num_blocks + c.max_num_seqs * per_seq
        kv = KVCache(geometry, num_blocks, s.device)
        runner = self.build_runner(model, kv, resolved_max_model_len(c) + c.num_speculative_tokens)
        log.info("draft model: %d KV blocks, %.1f MiB", num_blocks, kv.nbytes / 2**20)
        return ModelStack(model, kv, runner)
