"""Beam search on the embedded model as Hugging Face's ``generate(num_beams=...)`` finds it:
the reference the server's beam tests (TensorRT-LLM inputs, the OpenAI API) compare with."""

from __future__ import annotations

import torch

from slipstream.worker.model.gguf import default_model_dir
from support import reference_model

PROMPT = "The capital of France is"
MAX_TOKENS = 12


def hf_beams(width: int) -> tuple:
    """The ``width`` beams' texts (stop token not shown) and scores, best first."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    model = reference_model(default_model_dir())
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=MAX_TOKENS,
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            attention_mask=torch.ones_like(ids),
            pad_token_id=tokenizer.eos_token_id,
        )
    return [tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True) for row in out]
