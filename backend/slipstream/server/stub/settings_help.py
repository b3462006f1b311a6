"""What each setting of a model's config means, where vLLM's argument table
(``engine_args.ENGINE_ARGUMENTS``) does not already say it: Slipstream's own engine settings
and the server settings of ``model_config.SERVER_PARAMETERS``. docs/configuration.md is
generated from these tables (scripts/configuration_reference.py), and a test keeps every
setting described."""

from __future__ import annotations

# EngineConfig fields under Slipstream's own name (no vLLM argument of that name).
ENGINE_SETTINGS: dict[str, str] = {
    "policy": "scheduling: fifo, priority (a request's priority, lower first) or sjf "
    "(shortest prompt first); vLLM's scheduling_policy fcfs/priority sets it too",
    "aging_seconds": "priority/sjf: waiting this long raises a request one class",
    "swap_space_bytes": "CPU pool for swapped-out KV blocks, in bytes (vLLM's swap_space: GiB)",
    "swap_min_tokens": "preemption_mode auto: preempted requests shorter than this are "
    "recomputed, longer ones swapped (unset: max(2 blocks, max_num_batched_tokens / 4))",
    "max_queue_size": "waiting requests beyond which new ones are refused at once "
    "(UNAVAILABLE, 'server overloaded ... retry after 1 s'); 0 = unbounded",
    "tpot_target_ms": "stall-free batching: while requests decode, a step admits only the "
    "prompt tokens that keep its predicted time within this many ms (0 = off)",
    "batching": "continuous (in-flight), static or dynamic",
    "max_batch_size": "static/dynamic batching: the batch size",
    "max_queue_delay_ms": "dynamic batching: longest wait for a batch to fill",
    "speculative_method": "speculative decoding: unset (off), ngram (prompt lookup) or draft",
    "speculative_model": "draft model directory (speculative_method draft)",
    "num_speculative_tokens": "draft tokens proposed per step, at most",
    "ngram_prompt_lookup_max": "ngram: longest n-gram looked up in the prompt",
    "ngram_prompt_lookup_min": "ngram: shortest n-gram looked up in the prompt",
    "speculative_disable_by_batch_size": "no drafts while more requests than this run "
    "(vLLM's disable_by_batch_size); 0 = no limit",
    "cpu_threads_bind": "tensor parallelism on CPU: each rank's cores on this machine in "
    "vLLM's syntax ('0-31|32-63'); unset: the cores this process may use, split evenly",
    "speculative_row_budget": "a step's decode rows (one per running request plus its drafts) "
    "stay within this: drafts only while the batch is small; 0 = no cap",
    "enable_cuda_graphs": "CUDA: capture decode steps as CUDA graphs (vLLM's enforce_eager "
    "is its opposite)",
    "cuda_graph_batch_sizes": "CUDA: the batch sizes captured (comma-separated)",
    "cpu_linear": "CPU fp32 linear layers: auto (a compiled kernel over packed weights on "
    "AVX-512, else onednn), onednn, transposed or stock",
    "attention_ops": "paged-attention operators: auto (the compiled CPU kernel on CPU, OpenAI "
    "Triton kernels on CUDA), cpu, torch (the reference) or triton",
    "fast_forward": "CPU: Llama-style models run a lean forward over the same modules "
    "(logits bit-identical); others the Hugging Face forward",
    "trace_steps": "keep a per-step scheduler trace in memory",
    "trace_file": "write the per-step trace as Chrome trace JSON here on shutdown",
}

# model_config.SERVER_PARAMETERS: settings of the Triton model, not of the engine.
SERVER_SETTINGS: dict[str, str] = {
    "default_max_tokens": "max_tokens of a request that gives none (as Triton's vLLM backend)",
    "apply_chat_template": "wrap every prompt in the tokenizer's chat template unless the "
    "request says otherwise",
    "metrics_interval_ms": "how often the engine's gauges and counters are refreshed",
    "REPORT_CUSTOM_METRICS": "true/false; empty = on, except under backend vllm (the alias), "
    "as in Triton's vLLM backend",
    "ENABLE_VLLM_HEALTH_CHECK": "check the engine before each batch; when unhealthy unload "
    "the model and answer UNAVAILABLE",
    "metric_families": "slipstream, vllm, trtllm (comma-separated); empty = slipstream, "
    "plus vllm under backend slipstream",
    "engine_failure_threshold": "engine steps failing in a row that make the engine dead",
    "max_engine_restarts": "restarts of a dead engine inside the stub within 10 minutes; one "
    "more death takes the server down (its supervisor restarts it)",
    "step_timeout_s": "an engine step running longer is hung: its requests end with an error "
    "and the engine is dead (0 = no step watchdog)",
    "max_request_seconds": "a request running longer ends with an error (0 = no limit)",
    "decoupled": "false: one response per request (unary infer); otherwise decoupled",
    "compatibility": "trtllm: TensorRT-LLM's semantics and error texts; empty = vLLM's",
    "interface": "llmapi: TensorRT-LLM's LLM-API model's inputs and outputs",
    "kv_events_config": "publish KV cache events as vLLM does (vLLM's KVEventsConfig as JSON)",
}
