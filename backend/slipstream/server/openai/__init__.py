"""An OpenAI-compatible API in front of Triton (``slipstream serve --openai-port``).

Runs in the launcher's process (not in the Triton stub; the engine stays Triton-free) and
sends every generation through the Triton server over gRPC: ``served_models`` (which names a
client may use), ``requests`` (the request bodies and their mapping onto the model's
``sampling_parameters``), ``triton_client`` (the gRPC stream per generation), ``responses``
(the ``openai`` package's types), ``errors`` (OpenAI-style error bodies and statuses), ``app``
(the FastAPI routes) and ``frontend`` (uvicorn on a thread).
"""
