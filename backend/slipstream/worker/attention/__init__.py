"""Paged attention: the ``AttentionOps`` seam (``base``), the step's ``AttentionMetadata``
(``metadata``), one layer's caches and scoring (``layer``), the backends (``torch_backend``
the reference, ``cpu_backend`` the compiled CPU kernels, ``triton_backend`` OpenAI Triton on
CUDA) chosen by ``dispatch``, and the hook transformers' attention layers call
(``transformers_hook``)."""
