"""Builds what runs a model: the model itself, its paged KV cache and the runner that packs
steps for it. The engine builds its target model here, and the draft-model proposer its
draft model, with the same device, dtype and runner rules.

Order on a GPU, as vLLM sizes memory (``worker/memory_plan``): target model and LoRA slots,
draft model, then profiling steps, then the KV cache takes what ``gpu_memory_utilization`` of
the device's total memory leaves; the log states each figure."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from slipstream.core.config import EngineConfig
from slipstream.engine.executor.member import GroupMember
from slipstream.startup_log import Phase, phase
from slipstream.worker.cuda_graphs import capture_sizes
from slipstream.worker.device import DeviceSettings
from slipstream.worker.distributed.sharding import shard_of
from slipstream.worker.kv_cache import KVCache, KVGeometry, num_blocks_for_budget
from slipstream.worker.layers.linear import drop_stock_weights
from slipstream.worker.layers.memory import release_freed_memory
from slipstream.worker.layers.preparation import prepare_cpu_model
from slipstream.worker.layers.reduced_linear import WeightFormat
from slipstream.worker.lora.layers import LoraLayers, load_lora_layers
from slipstream.worker.memory_plan import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    BlockSizes,
    MemoryFigures,
    MemoryPlan,
    cpu_kv_bytes,
    plan_memory,
)
from slipstream.worker.memory_profile import (
    MemoryCheckpoint,
    decode_step,
    peak_above_now,
    prefill_step,
)
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
    """How many token ids the model embeds (its input embeddings' rows; a tensor-parallel
    rank holds a share of them: the whole vocabulary's)."""
    shard = shard_of(model)
    if shard is not None:
        return shard.vocab_size
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
    def __init__(
        self, config: EngineConfig, settings: DeviceSettings, member: Optional[GroupMember] = None
    ) -> None:
        """``member``: the rank of a tensor-parallel group this process is (None: the model
        is whole here)."""
        self.config = config
        self.settings = settings
        self.member = member
        self.gpu = settings.device.type == "cuda"
        # the device's memory before this engine loads anything, and after the target loads
        self._start = MemoryCheckpoint.take(settings.device) if self.gpu else None
        self._target_loaded: Optional[MemoryCheckpoint] = None
        self.memory_plan: Optional[MemoryPlan] = None  # the GPU sizing, once done

    # -- the target model --------------------------------------------------------------------
    def load_target(
        self,
        model: Optional[torch.nn.Module] = None,
        tokenizer: object = None,
        load_tokenizer: bool = True,
    ) -> TargetModel:
        """The served model (``model`` / ``tokenizer`` given: used as they are; a
        tensor-parallel rank's share of it), its CPU layers packed and its LoRA adapters
        loaded. ``load_tokenizer=False``: none (a rank other than 0 has no use for one)."""
        s = self.settings
        path: Optional[Path] = None
        if model is None:
            path = loader.resolve_model_path(self.config.model, s.quantization)
            # a rank's share is cut on the host, then moved to its device
            device = torch.device("cpu") if self.member is not None else s.device
            lean = self.config.fast_forward and s.device.type == "cpu"
            with phase(Phase.WEIGHT_LOAD, model=str(path)):
                model = loader.load_model(
                    path, s.dtype, device, lean=lean, quantization=s.quantization
                )
        elif self.member is not None:
            raise ValueError(
                "tensor parallelism loads the model from its path on every rank: give the "
                "engine a model path, not a model object"
            )
        if tokenizer is None and load_tokenizer:
            tokenizer = loader.load_tokenizer(path, self.config.tokenizer)
        config = self.config = fit_max_model_len(self.config, model.config)
        if self.member is not None:  # before packing: every format runs on the share
            self.member.shard(model)
            model.to(s.device)
        if s.device.type == "cpu":
            with phase(Phase.PACKING, weights=s.weight_format):
                prepare_cpu_model(model, s.weight_format, config.cpu_linear)
        lora = None
        if config.enable_lora:  # after packing: adapters wrap the packed linears
            lora = load_lora_layers(
                config.lora_modules, model, config.max_lora_rank, s.dtype, s.device
            )
        if self.gpu:
            self._target_loaded = MemoryCheckpoint.take(s.device)
        return TargetModel(model, tokenizer, config, lora)

    def load_draft(self, target: torch.nn.Module) -> Optional[torch.nn.Module]:
        """The draft-model proposer's model (None for other methods; the target itself when
        they are the same model), loaded before the KV cache is sized."""
        c, s = self.config, self.settings
        if c.speculative_method != "draft":
            return None
        if c.speculative_model == c.model:
            return target
        assert c.speculative_model is not None  # EngineConfig's validation
        model = loader.load_model(loader.resolve_model_path(c.speculative_model), s.dtype, s.device)
        if s.device.type == "cpu":  # the draft runs fp32 weights, whatever the target's
            prepare_cpu_model(model, WeightFormat.FLOAT32.value, c.cpu_linear)
        return model

    def allocate_kv_cache(
        self,
        model: torch.nn.Module,
        lora: Optional[LoraLayers] = None,
        draft: Optional[torch.nn.Module] = None,
    ) -> KVCache:
        """The target's cache: ``num_gpu_blocks_override`` blocks; what
        ``kv_cache_memory_bytes`` holds; or on a GPU, what ``gpu_memory_utilization`` leaves
        once weights (``draft`` included), activations and CUDA graphs are accounted."""
        c = self.config
        geometry = KVGeometry.from_model_config(model.config, c.block_size, self.settings.kv_dtype)
        if c.num_gpu_blocks_override is not None:
            num_blocks = c.num_gpu_blocks_override + 1  # + the scratch block
        elif self.gpu and c.kv_cache_memory_bytes is None:
            self.memory_plan = self._plan_gpu_memory(model, lora, draft, geometry)
            log.info("%s", self.memory_plan.describe())
            num_blocks = self.memory_plan.num_blocks
        else:
            num_blocks = num_blocks_for_budget(geometry, cpu_kv_bytes(c.kv_cache_memory_bytes))
        if self.member is not None:  # one block table for every rank
            num_blocks = self.member.agree_num_blocks(num_blocks)
        if num_blocks < 2:
            raise ValueError(
                f"KV budget holds {num_blocks} blocks of {geometry.bytes_per_block} bytes; raise "
                "kv_cache_memory_bytes"
            )
        mib = round(num_blocks * geometry.bytes_per_block / 2**20, 1)
        with phase(Phase.KV_ALLOCATION, blocks=num_blocks, block_size=geometry.block_size, mib=mib):
            if self.member is not None:
                return self.member.kv_cache(geometry, num_blocks, self.settings.device)
            return KVCache(geometry, num_blocks, self.settings.device)

    # -- GPU memory (worker/memory_plan: the arithmetic; here: the measurements) ---------------
    def _plan_gpu_memory(
        self,
        model: torch.nn.Module,
        lora: Optional[LoraLayers],
        draft: Optional[torch.nn.Module],
        geometry: KVGeometry,
    ) -> MemoryPlan:
        c, device = self.config, self.settings.device
        start, target = self._start, self._target_loaded
        assert start is not None  # taken on every GPU engine
        loaded = MemoryCheckpoint.take(device)
        target = target or loaded
        activations, graphs = self._profile(model, lora)
        blocks = BlockSizes(geometry.bytes_per_block)
        if draft is not None and draft is not model:
            draft_activations, draft_graphs = self._profile(draft, None)
            activations, graphs = max(activations, draft_activations), graphs + draft_graphs
        torch.cuda.empty_cache()  # the scratch caches' and profiling steps' memory
        if draft is not None:
            draft_geometry = self._draft_geometry(draft)
            blocks = BlockSizes(
                geometry.bytes_per_block, draft_geometry.bytes_per_block, self._draft_extra_blocks()
            )
        after = MemoryCheckpoint.take(device)
        figures = MemoryFigures(
            total=start.total,
            free_at_start=start.free,
            weights=target.allocated - start.allocated,
            draft_weights=loaded.allocated - target.allocated,
            activations=activations,
            cuda_graphs=graphs,
            non_torch=max((start.free - after.free) - (after.reserved - start.reserved), 0),
        )
        utilization = c.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        return plan_memory(figures, utilization, blocks)

    def _profile(self, model: torch.nn.Module, lora: Optional[LoraLayers]) -> tuple[int, int]:
        """(activation peak, CUDA-graph pool estimate) of ``model``, from profiling steps on a
        scratch cache: a prefill of ``max_num_batched_tokens`` tokens, a sampled decode step
        of the largest batch, and that decode step's forward alone at the largest graph
        batch (a graph's pool holds what its forward allocates; every graph keeps its logits)."""
        from slipstream.worker.sample.device_sampler import DeviceSampler

        c, s = self.config, self.settings
        sizes = self._graph_sizes(lora)
        max_model_len = resolved_max_model_len(c)
        prefill = prefill_step(c.max_num_batched_tokens, max_model_len, c.block_size)
        batch = max(min(c.max_num_seqs, c.max_num_batched_tokens), max(sizes, default=0))
        decode = decode_step(batch, c.block_size)
        geometry = KVGeometry.from_model_config(model.config, c.block_size, s.kv_dtype)
        kv = KVCache(geometry, max(prefill.num_blocks, decode.num_blocks), s.device)
        runner = ModelRunner(
            model, kv, s.device, max_model_len, 0, None, c.attention_ops, False, lora
        )
        sampler = DeviceSampler(c.seed)

        def run() -> None:
            for step in (prefill, decode):
                logits, _ = runner.execute(step.sched)
                sampler(logits, step.requests)

        with torch.inference_mode():
            activations = peak_above_now(run, s.device)
            graphs = 0
            if sizes:
                largest = decode_step(max(sizes), c.block_size).sched
                graphs = peak_above_now(lambda: runner.execute(largest), s.device)
                logits_row = input_vocab_size(model) * torch.finfo(s.dtype).bits // 8
                graphs += sum(sizes[:-1]) * logits_row
        return activations, graphs

    def _graph_sizes(self, lora: Optional[LoraLayers]) -> list[int]:
        c = self.config
        if not c.enable_cuda_graphs or lora is not None:  # the runner captures none then
            return []
        return capture_sizes(c.max_num_seqs, c.cuda_graph_batch_sizes)

    def _draft_geometry(self, draft: torch.nn.Module) -> KVGeometry:
        return KVGeometry.from_model_config(
            draft.config, self.config.block_size, self.settings.dtype
        )

    def _draft_extra_blocks(self) -> int:
        """Blocks the draft cache holds beyond the target's: each sequence's drafts."""
        c = self.config
        return c.max_num_seqs * (-(-(c.num_speculative_tokens + 1) // c.block_size) + 1)

    def build_runner(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        max_model_len: int,
        lora: Optional[LoraLayers] = None,
    ) -> ModelRunner:
        c = self.config
        graphs = c.enable_cuda_graphs
        if graphs and self.member is not None and self.settings.device.type == "cuda":
            log.warning(
                "tensor_parallel_size=%d: CUDA graphs are off (a step's collectives are not "
                "captured); decode steps run eagerly",
                c.tensor_parallel_size,
            )
            graphs = False
        before = MemoryCheckpoint.take(self.settings.device) if self.gpu else None
        make_runner = self.member.runner if self.member is not None else ModelRunner
        runner = make_runner(
            model,
            kv_cache,
            self.settings.device,
            max_model_len,
            c.max_num_seqs,
            c.cuda_graph_batch_sizes if graphs else None,
            c.attention_ops,
            c.fast_forward,
            lora,
        )
        if before is not None and runner.graphs is not None:
            taken = MemoryCheckpoint.take(self.settings.device).reserved - before.reserved
            planned = self.memory_plan.figures.cuda_graphs if self.memory_plan else None
            log.info(
                "CUDA graphs: %d batch sizes captured, %.2f GiB (planned %s)",
                len(runner.graphs.graphs),
                taken / 2**30,
                "-" if planned is None else f"{planned / 2**30:.2f} GiB",
            )
        if self.settings.device.type == "cpu":
            # fp32: the stock weights the packed copies replace
            drop_stock_weights(model, runner.forward.packed_only())
            # the lean forward stacks q, k, v and gate, up into one weight each: the layers'
            # own copies it freed go back to the OS (bf16: ~140 MB of heap otherwise kept)
            release_freed_memory()
        return runner

    # -- the draft model ---------------------------------------------------------------------
    def draft_stack(
        self, target: torch.nn.Module, draft: Optional[torch.nn.Module], target_num_blocks: int
    ) -> ModelStack:
        """The draft-model proposer's stack: ``draft`` (``load_draft``'s) on its own cache,
        room for everything the target cache can hold plus each sequence's drafts."""
        c, s = self.config, self.settings
        model = draft if draft is not None else self.load_draft(target)
        assert model is not None  # the draft method
        kv = KVCache(
            self._draft_geometry(model), target_num_blocks + self._draft_extra_blocks(), s.device
        )
        runner = self.build_runner(model, kv, resolved_max_model_len(c) + c.num_speculative_tokens)
        log.info("draft model: %d KV blocks, %.1f MiB", kv.num_blocks, kv.nbytes / 2**20)
        return ModelStack(model, kv, runner)
