"""Beam search of the default model (SmolLM2-135M-Instruct) through a real tritonserver
serving the documented TRT-LLM sample (``samples/trtllm_model_repository``, unary), against
Hugging Face's ``generate(num_beams=..., do_sample=False)`` on the same weights."""

from __future__ import annotations

import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

from slipstream.server.launch.launcher import TritonServer  # noqa: E402
from slipstream.server.launch.repository import render_model_repository  # noqa: E402
from beam_support import MAX_TOKENS, PROMPT, hf_beams  # noqa: E402
from support import need_tritonserver  # noqa: E402
from trtllm_support import SAMPLES, prepare_inputs, prepare_tensor  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow]


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
