"""Triton Inference Server around the engine, in rooms by where the code runs: ``stub/``
inside Triton's Python-backend stub, ``trtllm/`` TensorRT-LLM's vocabularies on the stub's
seam, ``launch/`` outside ``tritonserver`` (the ``slipstream`` command), ``openai/`` the
OpenAI-compatible frontend; ``triton_model`` is the composition root every ``model.py``
re-exports."""
