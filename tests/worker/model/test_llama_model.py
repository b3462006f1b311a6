"""The Llama stack built without transformers' model code (``worker/model/llama``): the same
weights and module arithmetic as the Hugging Face model, none of its imports in a serving
process, and everything it does not cover left to transformers."""

import json
import subprocess
import sys

import pytest
import torch

from slipstream import EngineConfig
from slipstream.engine import LLMEngine
from slipstream.worker.model import llama as llama_model, loader
from support import drop_checkpoint_tensor, reference_model, tiny_llama_variant, tiny_model_dir

# What transformers' model and config classes import, which a serving process on CPU avoids.
HEAVY_MODULES = (
    "torch._dynamo",
    "transformers.models.llama.modeling_llama",
    "transformers.configuration_utils",
    "sympy",
)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU engine's process")
def test_a_cpu_engine_on_a_llama_checkpoint_imports_no_transformers_model_or_config_code():
    path = tiny_model_dir("llama")
    proc = _run(
        "import sys, json\n"
        "from slipstream import EngineConfig, SamplingParams\n"
        "from slipstream.engine import LLMEngine\n"
        f"engine = LLMEngine(EngineConfig(model={str(path)!r}, num_gpu_blocks_override=64))\n"
        "out = engine.generate(['a b c'], SamplingParams(max_tokens=3, temperature=0))\n"
        "assert len(out[0].token_ids) == 3\n"
        f"print(json.dumps([m for m in {HEAVY_MODULES!r} if m in sys.modules]))\n"
        "print(type(engine.model).__module__)\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded, module = proc.stdout.strip().splitlines()[-2:]
    assert json.loads(loaded) == []
    assert module == "slipstream.worker.model.llama"


def test_the_engine_uses_transformers_model_when_the_lean_forward_is_off():
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir("llama")), num_gpu_blocks_override=32, fast_forward=False
        )
    )
    assert not isinstance(engine.model, llama_model.LlamaForCausalLM)


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gpt2"])
def test_other_architectures_are_not_built_here(arch):
    assert llama_model.read_shape(tiny_model_dir(arch)) is None


def test_a_scaled_rope_or_another_activation_is_left_to_transformers(tmp_path):
    scaled = tiny_llama_variant(
        tmp_path / "model",
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    )
    assert llama_model.read_shape(scaled) is None
    gelu = tiny_llama_variant(tmp_path / "b", hidden_act="gelu")
    assert llama_model.read_shape(gelu) is None


@pytest.mark.parametrize(
    "layout, tied",
    [
        ("untied", False),
        ("tied without a head tensor", True),  # SmolLM2's checkpoint
        ("tied in the config, a head of its own in the file", False),  # as transformers does
    ],
)
def test_weights_buffers_and_modules_match_the_hf_model(tmp_path, layout, tied):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("llama")
    if layout != "untied":
        path = tiny_llama_variant(tmp_path / "model", tie_word_embeddings=True)
    if tied:
        drop_checkpoint_tensor(path, "lm_head.weight")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    lean = loader.load_model(path, torch.float32, torch.device("cpu"), lean=True)
    assert isinstance(lean, llama_model.LlamaForCausalLM)
    assert (lean.lm_head.weight is lean.model.embed_tokens.weight) == tied
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    theirs = dict(hf.named_parameters(remove_duplicate=False))
    ours = dict(lean.named_parameters(remove_duplicate=False))
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name
    assert torch.equal(lean.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 7, hf.config.hidden_size, generator=gen) * 3
    positions = torch.tensor([[0, 1, 2, 5, 9, 100, 1000]])
    for a, b in zip(lean.model.rotary_emb(x, positions), hf.model.rotary_emb(x, positions)):
        assert torch.equal(a, b)
    assert torch.equal(lean.model.norm(x), hf.model.norm(x))
    layer, theirs_layer = lean.model.layers[0].mlp, hf.model.layers[0].mlp
    assert torch.equal(layer(x), theirs_layer(x))


def test_its_own_forward_gives_the_hf_models_logits():
    """The plain forward (int8's calibration pass at load) is the model's causal forward."""
    path = tiny_model_dir("llama")
    lean = loader.load_model(path, torch.float32, torch.device("cpu"), lean=True)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, lean.config.vocab_size, (1, 37), generator=gen)
    with torch.no_grad():
        ours = lean(input_ids=ids, use_cache=False).logits
        theirs = reference_model(path)(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_without_a_layers_weights_is_refused_by_name(tmp_path):
    target = tiny_llama_variant(tmp_path / "model")
    drop_checkpoint_tensor(target, "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        loader.load_model(target, torch.float32, torch.device("cpu"), lean=True)


def test_the_plain_tokenizer_class_loads_as_autotokenizer_would():
    from transformers import AutoTokenizer

    path = tiny_model_dir("llama")
    assert loader._tokenizer_class(path) in loader.PLAIN_TOKENIZER_CLASSES
    ours = loader.load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(theirs)
    text = "The lighthouse keeper's log, 1893: fog — 12 ships ✓ <|im_end|> done"
    assert ours(text).input_ids == theirs(text).input_ids
    ids = theirs(text).input_ids
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
        ids, skip_special_tokens=True
    )
    chat = [{"role": "user", "content": "Where is the pier?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert len(ours) == len(theirs)


@pytest.mark.parametrize("generation_file", [True, False])
def test_the_end_of_sequence_ids_are_read_as_transformers_reads_them(tmp_path, generation_file):
    from transformers import GenerationConfig

    target = tiny_llama_variant(tmp_path / "model", eos_token_id=[7, 9])
    generation = target / "generation_config.json"
    if generation_file:
        generation.write_text(json.dumps({"eos_token_id": 11, "bos_token_id": 1}))
    else:
        generation.unlink(missing_ok=True)
    lean = loader.load_model(target, torch.float32, torch.device("cpu"), lean=True)
    if generation_file:
        expected = GenerationConfig.from_pretrained(str(target)).eos_token_id
    else:
        from transformers import AutoConfig

        expected = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(target)))
        expected = expected.eos_token_id
    assert (
        lean.generation_config.eos_token_id == expected == ([7, 9] if not generation_file else 11)
    )
