"""torch: what runs the model on a device, in rooms by job.

``model/`` loads checkpoints and holds the forward paths (``forward.ModelForward`` picks one
per step); ``layers/`` the CPU linear layers and norms, with every weight format in
``layers/quantization/``; ``attention/`` the ``AttentionOps`` seam and its backends;
``kernels/`` the compiled CPU kernels (``csrc/``); ``sample/`` the samplers and structured
outputs; ``lora/`` adapters; ``distributed/`` tensor parallelism's ranks. At the top:
``model_runner`` (a scheduled step -> one ragged forward -> token ids), ``device`` (where and
in which formats a model runs), ``kv_cache``, ``memory_plan`` / ``memory_profile`` (GPU
memory sizing), ``transfer`` (a step's host <-> device copies), ``cuda_graphs``, ``swap``,
``pooling``. See docs/architecture.md, "Where is it"."""
