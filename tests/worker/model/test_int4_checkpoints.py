"""4-bit checkpoints served as they ship (``quantization=gguf / awq / gptq``): the engine's
greedy tokens on tiny checkpoints made in each tool's packing equal a float64 reference with
the dequantized weights; no float copy of a weight is made; the embedded model's own Q4_1
GGUF loads with exactly the weights of its float32 conversion."""

import pytest
import torch

from slipstream import EngineConfig, SamplingParams
from slipstream.engine import LLMEngine
from slipstream.worker import kernels
from slipstream.worker.layers import reduced_linear as rl
from int4_support import (
    engine_outliers,
    reference_greedy,
    tiny_config,
    write_gguf,
    write_int4_dir,
)
from support import chunked_engine, stack_and_loop_logits, tiny_model_dir

PROMPTS = [[5, 17, 300, 4000, 22, 9], [1000, 2000, 3000]]
TOKENS = 8


def _engine(model, **settings) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model),
            tokenizer=str(tiny_model_dir("llama")),
            device="cpu",
            block_size=4,
            max_num_seqs=4,
            max_model_len=128,
            num_gpu_blocks_override=64,
            **settings,
        )
    )


def _greedy(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    return [list(o.token_ids) for o in engine.generate(PROMPTS, params)]


def _check_against_reference(engine: LLMEngine, weights: dict, config: dict) -> None:
    outliers = engine_outliers(engine)
    assert len(outliers) == 2 * 7 + 1  # every layer (and the head) keeps channels apart
    expected = [reference_greedy(weights, config, outliers, p, TOKENS) for p in PROMPTS]
    assert _greedy(engine) == expected


def _no_float_weights(engine: LLMEngine) -> None:
    """Every linear weight is its plan's packed layout; nothing float of a linear's size is
    resident (a norm's float32 vector is all that is left)."""
    model = engine.model
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            assert module.weight.device.type == "meta"
    hidden = model.config.hidden_size
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.device.type != "meta":
            assert tensor.numel() <= 4 * hidden, name


@pytest.mark.parametrize(
    "scheme, options",
    [
        ("awq", dict(group=32)),
        ("awq", dict(group=64)),
        ("gptq", dict(group=32)),
        ("gptq", dict(group=64, act_order=True)),
        ("gptq", dict(group=32, v2=True)),
    ],
    ids=["awq-g32", "awq-g64", "gptq-g32", "gptq-act-order", "gptq-v2"],
)
def test_awq_and_gptq_checkpoints_serve_the_dequantized_models_greedy_tokens(
    tmp_path, scheme, options
):
    path, weights = write_int4_dir(tmp_path / scheme, scheme, **options)
    engine = _engine(path, quantization=scheme)
    assert engine.weight_format == "int4"
    _no_float_weights(engine)
    _check_against_reference(engine, weights, tiny_config())


@pytest.mark.parametrize("layer_type", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_checkpoints_serve_the_dequantized_models_greedy_tokens(tmp_path, layer_type):
    path, weights, config = write_gguf(tmp_path / "tiny.gguf", layer_type)
    engine = _engine(path, quantization="gguf")
    assert engine.weight_format == "int4"
    _no_float_weights(engine)
    _check_against_reference(engine, weights, config)


def test_the_scheme_is_read_from_the_checkpoint_when_not_set(tmp_path):
    """As vLLM does: an AWQ directory or a .gguf file is served as it ships."""
    path, _ = write_int4_dir(tmp_path / "awq", "awq")
    assert _engine(path).weight_format == "int4"
    gguf_path, _, _ = write_gguf(tmp_path / "tiny.gguf")
    assert _engine(gguf_path).weight_format == "int4"


def test_a_scheme_the_checkpoint_does_not_ship_is_refused(tmp_path):
    path, _ = write_int4_dir(tmp_path / "awq", "awq")
    with pytest.raises(ValueError, match="quantization=gptq, but .* holds awq weights"):
        _engine(path, quantization="gptq")
    with pytest.raises(ValueError, match="without a quantization_config"):
        _engine(tiny_model_dir("llama"), quantization="awq")
    with pytest.raises(ValueError, match="exactly one"):
        _engine(tiny_model_dir("llama"), quantization="gguf")


def test_int4_is_named_in_model_json_and_refused_on_cuda():
    from slipstream.server.stub.engine_arg_reader import translate
    from slipstream.worker.device import resolve_weight_format

    for scheme in ("gguf", "awq", "gptq"):
        assert translate({"quantization": scheme}).engine == {"quantization": scheme}
        with pytest.raises(ValueError, match="CPU only"):
            resolve_weight_format(EngineConfig(quantization=scheme), torch.device("cuda"))


def test_int4_decode_steps_on_the_stack_give_the_python_loops_logits_bit_for_bit(tmp_path):
    if not kernels.load():
        pytest.skip(f"no CPU kernels: {kernels.unavailable_reason()}")
    path, _, _ = write_gguf(tmp_path / "tiny.gguf", "Q4_1")
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)

    def engine() -> LLMEngine:
        return chunked_engine("llama", model=str(path), tokenizer=str(tiny_model_dir("llama")))

    loop, stack, calls = stack_and_loop_logits(engine, params)
    assert calls >= 4 and len(stack) == len(loop) > calls
    assert all(torch.equal(a, b) for a, b in zip(loop, stack))


@pytest.mark.slow
def test_the_embedded_models_gguf_loads_as_it_ships_with_its_conversions_weights():
    """Every linear weight of the shipped Q4_1 / Q8_0 blocks equals the float32 conversion's
    (transformers' GGUF dequantization) exactly, held in 4-bit and int8 blocks only."""
    from safetensors import safe_open

    from slipstream.worker.model import gguf_checkpoint
    from slipstream.worker.model.gguf import default_gguf_path, default_model_dir

    model = gguf_checkpoint.load(default_gguf_path())
    converted = default_model_dir() / "model.safetensors"
    held = 0
    with safe_open(str(converted), framework="pt") as f:
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            plan = rl.applied_plan(module)
            assert plan is not None and module.weight.device.type == "meta"
            layout = plan.q4 if plan.q4 is not None else plan.q8
            assert layout is not None
            held += layout.nbytes
            key = "model.embed_tokens.weight" if name == "lm_head" else f"{name}.weight"
            assert torch.equal(layout.dequantized(), f.get_tensor(key)), name
        for name in ("model.norm.weight", "model.layers.3.input_layernorm.weight"):
            assert torch.equal(model.get_parameter(name), f.get_tensor(name))
    # 4-bit layers and an int8 head: ~100 MB, where float32 would be ~540 MB
    assert held < 110 * 2**20
