"""Beam search of the default model (SmolLM2-135M-Instruct) through a real tritonserver
serving the documented TRT-LLM sample (``samples/trtllm_model_repository``, unary), against
Hugging Face's ``generate(num_beams=..., do_sample=False)`` on the same weights."""

from __future__ import annotations

import pytest
import torch

grpcclient = pytest.importorskip("tritonclient.grpc")

from slipstream.server.launch.launcher import TritonServer  # noqa: E402
from slipstream.server.launch.repository import render_model_repository  # noqa: E402
from slipstream.worker.model.gguf import default_model_dir  # noqa: E402
from support import need_tritonserver, reference_model  # noqa: E402
from trtllm_support import SAMPLES, prepare_inputs, prepare_tensor  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow]
PROMPT = "The capital of France is"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_tritonserver()
    repo = render_model_repository(
        SAMPLES["ensemble"],
        tmp_path_factory.mktemp("beams"),
        {
            "model": "default",
            "kv_cache_memory_bytes": 32 * 1024 * 1024,
            "max_model_len": 512,
            "max_num_seqs": 8,
        },
    )
    with TritonServer(
        repo, http_port=0, grpc_port=0, metrics_port=0, models=["ensemble"], startup_timeout=300
    ) as srv:
        yield srv


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


@pytest.mark.parametrize("width", [2, 3])
def test_default_model_beams_equal_hf_generate_num_beams(server, width):
    """`end_to_end_grpc_client.py -b W --return-log-probs` (unary `infer`): the W beams the
    server returns, best first, are Hugging Face's W beams."""
    inputs = prepare_inputs(
        PROMPT, MAX_TOKENS, beam_width=width, return_log_probs=True, exclude_input_in_output=True
    )
    del inputs["stream"]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    names = ["text_output", "cum_log_probs", "output_log_probs"]
    result = client.infer(
        "ensemble",
        [prepare_tensor(k, v) for k, v in inputs.items()],
        outputs=[grpcclient.InferRequestedOutput(n) for n in names],
    )
    texts = [t.decode() for t in result.as_numpy("text_output").reshape(-1)]
    assert texts == hf_beams(width)
    cum, per_token = result.as_numpy("cum_log_probs"), result.as_numpy("output_log_probs")
    assert cum.shape == (1, width) and per_token.shape[:2] == (1, width)
    assert cum[0] == pytest.approx(per_token[0].sum(axis=-1), abs=1e-3)  # zero-padded
