"""Every weight format the CPU products read, one module each: ``bf16`` (panels for
``cpu_bf16_gemm``), ``int8`` (blocks of 32 for ``cpu_q8_gemm``, with ``int8_outliers``),
``int4`` (the one 4-bit form for ``cpu_q4_gemm``) and the 4-bit checkpoints turned into it
as they ship (``gguf``, ``awq``, ``gptq``); ``panel_layout`` is their shared packing."""
