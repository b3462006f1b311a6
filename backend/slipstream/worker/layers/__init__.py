"""A loaded model's layers made ready for the CPU engine (``preparation.prepare_cpu_model``,
the one entry): fp32 linears (``linear``), bf16 / int8 / 4-bit linears (``reduced_linear``,
with each weight format in ``quantization/``), norms (``norm``) and where weight memory goes
(``memory``)."""
