"""Engine configuration: one validated dataclass shared by every component."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from slipstream.core.block_hash import HASH_ALGOS
from slipstream.core.boolean_text import SETTING, parse_bool
from slipstream.core.field_values import from_values

BATCHING_MODES = ("continuous", "static", "dynamic")
POLICIES = ("fifo", "priority", "sjf")
PREEMPTION_MODES = ("recompute", "swap", "auto")
DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")  # auto: the activations' dtype
# int8: weights and activations in blocks of 32, made at load (worker/layers/quantization/int8);
# gguf / awq / gptq: a 4-bit checkpoint served as it ships (CPU; quantization/int4)
QUANTIZATIONS = (None, "int8", "gguf", "awq", "gptq")
CPU_LINEARS = ("auto", "onednn", "transposed", "stock")  # worker/layers/linear.py
ATTENTION_OPS = ("auto", "torch", "cpu", "triton")  # worker/attention/dispatch.py


# Settings that must be integers >= 1.
_POSITIVE = (
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_batch_size",
    "num_speculative_tokens",
    "max_loras",
    "max_lora_rank",
    "tensor_parallel_size",
    "nnodes",
)
# Settings with a closed set of values, in the order they are checked.
_CHOICES: tuple[tuple[str, tuple[Optional[str], ...]], ...] = (
    ("batching", BATCHING_MODES),
    ("policy", POLICIES),
    ("preemption_mode", PREEMPTION_MODES),
    ("prefix_caching_hash_algo", HASH_ALGOS),
    ("attention_ops", ATTENTION_OPS),
    ("cpu_linear", CPU_LINEARS),
    ("dtype", DTYPES),
    ("quantization", QUANTIZATIONS),
    ("kv_cache_dtype", KV_CACHE_DTYPES),
)
# Optional integer settings (their default None says nothing about their type).
_OPTIONAL_INTS = (
    "kv_cache_memory_bytes",
    "num_gpu_blocks_override",
    "max_model_len",
    "swap_min_tokens",
)


def _check_count(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        rule = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ValueError(f"{name} must be {rule}, got {value!r}")


@dataclass
class EngineConfig:
    """Settings of one engine instance.

    The KV cache size is derived, not given: ``kv_cache_memory_bytes`` (1 GiB on CPU when
    unset), or on a GPU without it, what ``gpu_memory_utilization`` of the device's total
    memory leaves once weights, activations and CUDA graphs are accounted (vLLM's sizing,
    ``worker/memory_plan``), divided by the bytes one block takes for the loaded model's
    layers, KV heads, head dim and dtype.
    """

    model: str = "default"  # "default" = embedded SmolLM2, or a local HF model directory
    tokenizer: Optional[str] = None
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    # CPU: bfloat16 / int8 hold the linear layers' weights so (activations stay float32);
    # gguf / awq / gptq serve such a checkpoint's 4-bit blocks as they ship (None: read from
    # the checkpoint, as vLLM does: a .gguf file, or config.json's quantization_config)
    quantization: Optional[str] = None
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto = cuda when available, else cpu
    seed: int = 0

    block_size: int = 16
    # bytes of the KV pool (vLLM's: set, it overrides gpu_memory_utilization); unset: 1 GiB on
    # CPU, on CUDA the share gpu_memory_utilization leaves
    kv_cache_memory_bytes: Optional[int] = None
    # CUDA: the share of the GPU's TOTAL memory this engine may use (vLLM's meaning; 0.9 when
    # unset), weights, activations, CUDA graphs and KV cache together
    gpu_memory_utilization: Optional[float] = None
    num_gpu_blocks_override: Optional[int] = None  # tests: exact number of KV blocks

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # vLLM's serving default
    max_model_len: Optional[int] = None  # None = the model's position limit
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # Stall-free batching (core/step_budget.py): while requests decode, a step takes only
    # the prompt tokens that keep its predicted time within this many ms (0: off, every step
    # fills max_num_batched_tokens, which stays the hard limit either way).
    tpot_target_ms: float = 0.0
    # How full blocks are named: "builtin" (fast) or vLLM's "sha256_cbor" (the hashes its KV
    # events carry and KV-aware routers compute; chosen automatically with kv_events_config).
    prefix_caching_hash_algo: str = "builtin"

    batching: str = "continuous"
    max_batch_size: int = 8  # static / dynamic batch size
    max_queue_delay_ms: float = 10.0  # dynamic: how long to wait for a batch to fill

    policy: str = "fifo"
    aging_seconds: float = 5.0  # sjf/priority: waiting this long raises a request one class
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 256 * 1024 * 1024
    max_queue_size: int = 0  # 0 = unbounded waiting queue

    speculative_method: Optional[str] = None  # None, "ngram" or "draft"
    num_speculative_tokens: int = 4
    speculative_model: Optional[str] = None
    # vLLM's disable_by_batch_size: no drafts in a step while more requests than this run
    # (0: no limit). Verifying drafts is nearly free while a step is bound by reading the
    # weights (few rows), and costs compute once the batch is large.
    speculative_disable_by_batch_size: int = 0
    # Drafts per request in a step are capped so that the step's decode rows (one per
    # running request, plus drafts) stay within this (0: no cap).
    speculative_row_budget: int = 0
    ngram_prompt_lookup_max: int = 3
    ngram_prompt_lookup_min: int = 1

    enable_cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    cpu_linear: str = "auto"  # CPU fp32: the compiled kernel; "onednn", "transposed", "stock"
    attention_ops: str = "auto"  # auto: cpu kernel on CPU, triton on CUDA; or torch, cpu, triton
    fast_forward: bool = True  # CPU: Llama-style models skip the HF forward's wrappers
    enable_lora: bool = False  # serve PEFT adapters per request (lora_name)
    lora_modules: dict[str, str] = field(default_factory=dict)  # adapter name -> PEFT directory
    max_loras: int = 1  # distinct adapters in one step (vLLM's default)
    max_lora_rank: int = 16  # adapters of a higher rank are refused at load (vLLM's default)
    trace_steps: bool = False  # keep a per-step scheduler trace (engine.tracer)
    trace_file: Optional[str] = None  # implies trace_steps; EngineLoop writes it on shutdown
    # Swap mode "auto": preempted requests with fewer tokens than this are recomputed, longer
    # ones swapped (None: max(2 blocks, max_num_batched_tokens / 4); core/swap_space.py).
    swap_min_tokens: Optional[int] = None

    # Tensor parallelism (engine/executor): the model's heads, MLP and vocabulary split over
    # this many ranks, one process each, torch.distributed between them (gloo on CPU, NCCL on
    # CUDA); the scheduler and the sampler run on rank 0, in this process.
    tensor_parallel_size: int = 1
    # Machines the ranks span (tensor_parallel_size / nnodes ranks each); the others run
    # `slipstream serve --node-rank K` headless (vLLM's --nnodes / --master-addr / -port).
    nnodes: int = 1
    master_addr: str = "127.0.0.1"  # rank 0's address as the other ranks reach it
    master_port: int = 0  # rank 0's rendezvous port; 0: any free one (one machine only)
    # CPU cores of each rank on this machine, vLLM's syntax: "0-31|32-63" (None: the cores
    # this process may use, split evenly)
    cpu_threads_bind: Optional[str] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse an inconsistent configuration, in a fixed order (the first problem found is
        the one reported)."""
        self._validate_counts()
        for name, choices in _CHOICES:
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        self._validate_queue_and_memory()
        self._validate_speculation()
        self._validate_lora()
        self._validate_parallel()
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )

    def _validate_counts(self) -> None:
        for name in _POSITIVE:
            _check_count(name, getattr(self, name), low=1)
        if self.max_model_len is not None:
            _check_count("max_model_len", self.max_model_len, low=1)
        for name in ("speculative_disable_by_batch_size", "speculative_row_budget"):
            _check_count(name, getattr(self, name), low=0)
        if self.swap_min_tokens is not None:
            _check_count("swap_min_tokens", self.swap_min_tokens, low=0)
        if not isinstance(self.tpot_target_ms, (int, float)) or self.tpot_target_ms < 0:
            raise ValueError(f"tpot_target_ms must be a number >= 0, got {self.tpot_target_ms!r}")

    def _validate_queue_and_memory(self) -> None:
        if self.max_queue_delay_ms < 0:
            raise ValueError("max_queue_delay_ms must be >= 0")
        if self.max_queue_size < 0:
            raise ValueError("max_queue_size must be >= 0 (0 = unbounded)")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override <= 0:
            raise ValueError("num_gpu_blocks_override must be positive")

    def _validate_speculation(self) -> None:
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError(
                "speculative_method must be None, 'ngram' or 'draft', got "
                f"{self.speculative_method!r}"
            )
        if self.speculative_method == "draft" and not self.speculative_model:
            raise ValueError("speculative_method='draft' needs speculative_model")

    def _validate_lora(self) -> None:
        if self.lora_modules is None:
            self.lora_modules = {}
        if isinstance(self.lora_modules, str):  # a JSON object, as multi_lora.json holds it
            try:
                self.lora_modules = json.loads(self.lora_modules) if self.lora_modules else {}
            except ValueError as e:
                raise ValueError(f"lora_modules must be a JSON object: {e}") from None
        if not isinstance(self.lora_modules, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) and v
            for k, v in self.lora_modules.items()
        ):
            raise ValueError("lora_modules must map adapter names to PEFT directories")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")

    def _validate_parallel(self) -> None:
        """What a tensor-parallel group can serve; a combination it cannot is named."""
        tp = self.tensor_parallel_size
        if tp % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size={tp} must be a multiple of nnodes={self.nnodes} "
                "(each machine runs the same number of ranks)"
            )
        _check_count("master_port", self.master_port, low=0)
        if self.master_port > 65535:
            raise ValueError(f"master_port must be a TCP port (0-65535), got {self.master_port}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError(
                f"nnodes={self.nnodes} needs master_port: the other machines' ranks must know "
                "where rank 0 listens"
            )
        if tp == 1:
            return
        refused = (
            (
                self.preemption_mode != "recompute",
                f"preemption_mode={self.preemption_mode!r} (the swap pool would hold rank 0's "
                "KV heads only); use 'recompute'",
            ),
            (self.enable_lora, "enable_lora (adapters are not sharded)"),
            (
                self.quantization in ("gguf", "awq", "gptq"),
                f"quantization={self.quantization!r} (a 4-bit checkpoint's blocks are not "
                "sharded); serve it with tensor_parallel_size=1",
            ),
            (
                self.speculative_method == "draft",
                "speculative_method='draft' (the draft model is not sharded); 'ngram' works",
            ),
        )
        for bad, what in refused:
            if bad:
                raise ValueError(f"tensor_parallel_size={tp} cannot serve {what}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EngineConfig":
        """Build from string-valued settings (Triton config parameters, CLI flags)."""
        return from_values(
            cls,
            values,
            lambda f, raw: _coerce(f.name, raw, f.default),
            lambda key: f"unknown engine setting {key!r}",
        )


def _bool(text: str) -> bool:
    value = parse_bool(text, SETTING)
    if value is None:
        raise ValueError(text)
    return value


def _coerce(key: str, raw: Any, default: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    if text.lower() in ("none", "null", ""):
        return None
    try:
        if isinstance(default, bool):
            return _bool(text)
        if isinstance(default, int) or key in _OPTIONAL_INTS:
            return int(float(text)) if "e" in text.lower() else int(text)
        if isinstance(default, float) or key == "gpu_memory_utilization":
            return float(text)
        if isinstance(default, tuple):
            return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"engine setting {key!r}: cannot parse {raw!r}") from None
    return text
