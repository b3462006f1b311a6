"""Turning a step's logits into tokens: the CPU ``Sampler`` (``sampler``, drawing with
``token_draw`` and the compiled row statistics), the device sampler for GPUs
(``device_sampler``, ``device_draw``, ``uniform_streams``: one device-to-host copy a step),
and structured outputs' grammars and masks (``structured_output``)."""
