"""int8's outlier channels: found at load by one forward on random token ids, per layer."""

import logging

import torch

from slipstream.worker.layers.quantization import int8_outliers
from slipstream.worker.model.loader import load_model
from support import tiny_model_dir


def test_a_loud_channel_of_the_residual_stream_is_found_for_the_layers_that_read_it():
    model = load_model(tiny_model_dir("llama"), torch.float32, "cpu")
    layer = model.model.layers[1]
    with torch.no_grad():
        layer.input_layernorm.weight[13] *= 200  # q, k, v read channel 13 at 200x
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    found = int8_outliers.find(model, linears, k=4)
    attn = layer.self_attn
    assert all(13 in found[m].tolist() for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert all(len(found[m]) == 4 for m in linears)
    assert torch.equal(found[attn.q_proj], found[attn.k_proj])  # one input, one set: they stack
    again = int8_outliers.find(model, linears, k=4)  # fixed seed: the same channels
    assert all(torch.equal(found[m], again[m]) for m in linears)


def test_a_model_without_a_causal_lm_forward_gets_none_and_says_so(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with caplog.at_level(logging.WARNING, logger="slipstream"):
        assert int8_outliers.find(model, list(model)) == {}
    assert "no outlier channels" in caplog.text
