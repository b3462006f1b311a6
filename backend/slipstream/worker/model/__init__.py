"""Models: finding and loading them (``loader``; the embedded default and GGUF in ``gguf``;
4-bit checkpoints as they ship in ``gguf_checkpoint`` / ``int4_checkpoint``; a plain Llama
built without transformers' model code in ``llama``), and the forward paths a step can take,
chosen in one place (``forward.ModelForward``): transformers' own modules, the lean forward
(``lean_forward``) and the compiled decode stack (``decode_stack``)."""
