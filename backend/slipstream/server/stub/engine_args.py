"""vLLM's engine arguments, declared once: each one's name (the ``1/model.json`` key, the
``--set`` key and config.pbtxt parameter, the ``slipstream serve --flag``), its type, its help,
and what Slipstream does with it. ``model.json``, config parameters, the command line and the
generated reference (docs/configuration.md) all read ``ENGINE_ARGUMENTS``.

Every argument is one of:

* ``SETS``: it decides ``EngineConfig`` settings, under the same name (``max_num_seqs``) or
  converted (``enforce_eager`` -> ``enable_cuda_graphs``, ``swap_space`` GiB -> bytes ...);
* ``ONLY_AT``: accepted only at the value that means "nothing to do" here
  (``pipeline_parallel_size: 1`` ...): any other value is refused, since this engine could not
  honour it;
* ``SERVER``: a server option of the model (``disable_log_stats`` turns the custom metrics
  off, ``max_logprobs``, ``kv_events_config``);
* ``NO_EFFECT``: accepted, without effect on what a Triton model serves (log switches);
* ``REMOVED``: removed from vLLM since; accepted with a warning (old model.json files).

Slipstream's own setting names (``enable_cuda_graphs``, ``policy`` ...) stay valid config
parameters: each vLLM name is an alias of the settings it decides, and two names deciding
one setting in the same place are refused. Triton's vLLM backend feeds ``model.json`` to
vLLM's ``AsyncEngineArgs``, where an unknown key fails the load: so it does here.

Pure Python: the tests and ``slipstream serve`` check a repository without starting Triton.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from slipstream.core.block_hash import HASH_ALGOS
from slipstream.core.config import KV_CACHE_DTYPES, PREEMPTION_MODES, EngineConfig
from slipstream.server.stub.engine_arg_values import (
    GIB,
    POLICIES,
    SPECULATIVE_KEYS,
    Converter,
    convert_adapters,
    convert_dtype,
    convert_hash_algo,
    convert_kv_cache_dtype,
    convert_quantization,
    convert_scheduling_policy,
    convert_speculative_config,
    convert_swap_space,
    shown_speculative_config,
    switch,
)


class Effect(enum.Enum):
    SETS = "sets"
    ONLY_AT = "only at"
    SERVER = "server option"
    NO_EFFECT = "no effect"
    REMOVED = "removed from vLLM"


class ArgType(enum.Enum):
    INT = "int"
    FLOAT = "float"
    STR = "str"
    BOOL = "bool"
    JSON = "json"  # a JSON object (or its text)
    ADAPTERS = "name=path"  # LoRA adapters: a JSON object, or name=path pairs on the command line


@dataclass(frozen=True)
class EngineArgument:
    name: str  # vLLM's name; the flag is --name-with-dashes
    type: ArgType
    effect: Effect
    help: str
    settings: tuple[str, ...] = ()  # the EngineConfig fields it decides (SETS)
    # value -> settings; None: the value goes to settings[0] as it is (EngineConfig checks it)
    convert: Optional[Converter] = None
    only: Any = None  # ONLY_AT: the one value accepted
    choices: tuple[str, ...] = ()
    # what the argument is in a built config (the default a flag's help shows); None: the
    # value of settings[0]
    shown: Optional[Callable[[EngineConfig], Any]] = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def default_in(self, config: EngineConfig) -> Any:
        """Its value in ``config`` (None where one cannot be told)."""
        if self.effect is Effect.ONLY_AT:
            return self.only
        if self.shown is not None:
            return self.shown(config)
        return getattr(config, self.settings[0]) if self.settings else None


def _same(name: str, type: ArgType, help: str, **extra: Any) -> EngineArgument:
    """An argument that is the EngineConfig setting of the same name."""
    return EngineArgument(name, type, Effect.SETS, help, settings=(name,), **extra)


def _switch(name: str, help: str) -> EngineArgument:
    """An on/off argument that is the EngineConfig setting of the same name."""
    return _same(name, ArgType.BOOL, help, convert=switch(name, name))


def _only(name: str, type: ArgType, only: Any, why: str) -> EngineArgument:
    return EngineArgument(name, type, Effect.ONLY_AT, why, only=only)


T, E = ArgType, Effect  # short names for the table
ENGINE_ARGUMENTS: tuple[EngineArgument, ...] = (
    # --- the model
    _same(
        "model",
        T.STR,
        "'default' (the embedded SmolLM2-135M-Instruct) or a Hugging Face model "
        "directory (absolute, or relative to the model's directory); nothing is downloaded",
    ),
    _same("tokenizer", T.STR, "tokenizer directory (default: the model's own)"),
    _same(
        "dtype",
        T.STR,
        "weights and activations: auto (float32 on CPU, "
        "bfloat16 on CUDA), float32, float16, bfloat16; on CPU bfloat16 holds the "
        "linear layers' weights in bf16",
        convert=convert_dtype,
        choices=("auto", "float32", "float", "float16", "half", "bfloat16"),
    ),
    _same(
        "quantization",
        T.STR,
        "int8: every linear layer quantized at load; gguf / awq / gptq: a 4-bit "
        "checkpoint's blocks served as they ship (default model: its own Q4_1 GGUF); CPU; "
        "none: unquantized",
        convert=convert_quantization,
        choices=("none", "int8", "gguf", "awq", "gptq"),
    ),
    _same("seed", T.INT, "the engine's random seed (a request's own seed wins)"),
    _same("device", T.STR, "auto (CUDA when available), cpu, cuda, cuda:N"),
    # --- memory
    _same(
        "kv_cache_dtype",
        T.STR,
        "KV cache: auto (the model's dtype), float32, bfloat16",
        convert=convert_kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
    ),
    _same("block_size", T.INT, "tokens per KV cache block"),
    _same(
        "gpu_memory_utilization",
        T.FLOAT,
        "CUDA: fraction of the GPU's free memory the KV cache "
        "takes (instead of kv_cache_memory_bytes)",
    ),
    _same("kv_cache_memory_bytes", T.INT, "bytes of the KV cache pool"),
    _same("num_gpu_blocks_override", T.INT, "exact number of KV cache blocks"),
    EngineArgument(
        "swap_space",
        T.FLOAT,
        E.SETS,
        "GiB of CPU memory for preempted requests' KV blocks (preemption_mode swap/auto)",
        settings=("swap_space_bytes",),
        convert=convert_swap_space,
        shown=lambda c: c.swap_space_bytes / GIB,
    ),
    # --- scheduling
    _same(
        "max_model_len",
        T.INT,
        "longest prompt + output; unset: the model's position limit",
    ),
    _same("max_num_seqs", T.INT, "most requests in one engine step"),
    _same("max_num_batched_tokens", T.INT, "token budget of one engine step"),
    _switch("enable_chunked_prefill", "split long prompts across steps"),
    _switch("enable_prefix_caching", "reuse the KV blocks of shared prompt prefixes"),
    _same(
        "prefix_caching_hash_algo",
        T.STR,
        "how full blocks are named: "
        "builtin (fastest) or sha256_cbor (vLLM's, what KV events carry)",
        convert=convert_hash_algo,
        choices=HASH_ALGOS,
    ),
    EngineArgument(
        "scheduling_policy",
        T.STR,
        E.SETS,
        "fcfs, or priority (a request's priority, lower first)",
        settings=("policy",),
        convert=convert_scheduling_policy,
        choices=tuple(POLICIES),
        shown=lambda c: {v: k for k, v in POLICIES.items()}.get(c.policy, c.policy),
    ),
    _same(
        "preemption_mode",
        T.STR,
        "when KV blocks run out: recompute, swap or auto",
        choices=PREEMPTION_MODES,
    ),
    EngineArgument(
        "enforce_eager",
        T.BOOL,
        E.SETS,
        "CUDA: no CUDA graphs (every step runs eagerly)",
        settings=("enable_cuda_graphs",),
        convert=switch("enforce_eager", "enable_cuda_graphs", invert=True),
        shown=lambda c: not c.enable_cuda_graphs,
    ),
    EngineArgument(
        "speculative_config",
        T.JSON,
        E.SETS,
        "speculative decoding, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' or a draft "model"',
        settings=("speculative_method", *SPECULATIVE_KEYS.values()),
        convert=convert_speculative_config,
        shown=shown_speculative_config,
    ),
    # --- LoRA
    _switch("enable_lora", "serve LoRA adapters per request"),
    _same(
        "lora_modules",
        T.ADAPTERS,
        "LoRA adapters: name=path pairs (a JSON object in model.json or --set)",
        convert=convert_adapters,
        shown=lambda c: None,
    ),
    _same("max_loras", T.INT, "most distinct adapters among the requests of one step"),
    _same("max_lora_rank", T.INT, "adapters of a higher rank are refused at load"),
    # --- tensor parallelism (engine/executor): vLLM's multi-machine names for rank 0's
    # rendezvous; the serve command's --nnodes / --node-rank / --master-addr / --master-port
    _same(
        "tensor_parallel_size",
        T.INT,
        "split the model over this many ranks, one process each (torch.distributed: gloo on "
        "CPU, NCCL on CUDA); docs/tensor_parallel.md",
    ),
    _same("nnodes", T.INT, "machines the tensor-parallel ranks span", shown=lambda c: None),
    _same(
        "master_addr", T.STR, "rank 0's address as other machines reach it", shown=lambda c: None
    ),
    _same("master_port", T.INT, "rank 0's rendezvous port", shown=lambda c: None),
    # --- accepted only where they ask for nothing
    _only(
        "node_rank",
        T.INT,
        0,
        "Triton serves on rank 0's machine; the others run `slipstream serve --node-rank K` "
        "headless",
    ),
    _only("pipeline_parallel_size", T.INT, 1, "the model is split by tensor parallelism only"),
    _only(
        "data_parallel_size",
        T.INT,
        1,
        "one engine per model instance (Triton's instance_group and replicas scale out)",
    ),
    _only("enable_expert_parallel", T.BOOL, False, "no mixture-of-experts model is served"),
    _only("trust_remote_code", T.BOOL, False, "only architectures built into transformers load"),
    _only("tokenizer_mode", T.STR, "auto", "the model's Hugging Face tokenizer is used"),
    _only("load_format", T.STR, "auto", "weights load with transformers' from_pretrained"),
    _only("skip_tokenizer_init", T.BOOL, False, "requests are text and need the tokenizer"),
    # --- server options
    EngineArgument("disable_log_stats", T.BOOL, E.SERVER, "no custom metrics"),
    EngineArgument(
        "max_logprobs",
        T.INT,
        E.SERVER,
        "most logprobs a request may ask for",
        shown=lambda c: 20,
    ),
    EngineArgument(
        "kv_events_config",
        T.JSON,
        E.SERVER,
        "publish KV cache events as vLLM does (vLLM's KVEventsConfig fields)",
    ),
    # --- no effect on what a Triton model serves
    EngineArgument(
        "served_model_name",
        T.STR,
        E.NO_EFFECT,
        "Triton names a model by its directory (slipstream serve --served-model-name renames it)",
    ),
    EngineArgument("disable_log_requests", T.BOOL, E.NO_EFFECT, "requests are not logged"),
    EngineArgument("enable_log_requests", T.BOOL, E.NO_EFFECT, "requests are not logged"),
    EngineArgument("distributed_executor_backend", T.STR, E.NO_EFFECT, "one process per model"),
    EngineArgument("disable_custom_all_reduce", T.BOOL, E.NO_EFFECT, "no all-reduce"),
    EngineArgument("max_seq_len_to_capture", T.INT, E.NO_EFFECT, "decode graphs cover any length"),
    EngineArgument("max_cpu_loras", T.INT, E.NO_EFFECT, "adapters stay loaded"),
    EngineArgument(
        "lora_extra_vocab_size",
        T.INT,
        E.REMOVED,
        "LoRA adapters here never add vocabulary (vLLM dropped the argument as well)",
    ),
)
BY_NAME = {a.name: a for a in ENGINE_ARGUMENTS}


def settings_of(name: str) -> frozenset[str]:
    """The EngineConfig settings a parameter decides: an argument's, or a setting's own name."""
    argument = BY_NAME.get(name)
    return frozenset(argument.settings) if argument is not None else frozenset({name})


def aliases_in(names: Iterable[str], name: str) -> list[str]:
    """The names among ``names``, other than ``name``, that decide a setting ``name`` decides."""
    mine = settings_of(name)
    return [n for n in names if n != name and settings_of(n) & mine]


def conflicts(names: Iterable[str]) -> list[str]:
    """'a and b both set s' for every setting two of ``names`` decide."""
    first: dict[str, str] = {}
    found = []
    for name in names:
        for setting in sorted(settings_of(name)):
            other = first.setdefault(setting, name)
            if other != name:
                found.append(f"{other} and {name} both set {setting}: give one")
    return found
