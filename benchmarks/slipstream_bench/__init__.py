"""``slipstream bench``: a load generator and the baselines it is compared with.

One module per job: ``workload`` (what to send), ``loadgen`` (send it to tritonserver over
gRPC streaming), ``inprocess`` (the same workload on the engine without Triton),
``hf_baselines`` (Hugging Face ``generate`` and continuous batching), ``roofline`` (the raw
forward cost of the steps the run used), ``timeline`` (the engine's step trace), ``metrics``,
``plots``, ``report``, ``runner`` / ``prefix`` (the two scenarios) and ``cli``.
"""
