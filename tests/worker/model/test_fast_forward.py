"""The lean CPU forward: the Hugging Face forward's logits, bit for bit, for the Llama-style
models it accepts; every other model keeps the Hugging Face forward."""

import pytest
import torch

from slipstream import EngineConfig, SamplingParams
from slipstream.engine import LLMEngine
from slipstream.worker.model.lean_forward import FastForward
from support import chunked_engine, step_logits, tiny_model_dir


def greedy_step_logits(arch: str, fast: bool) -> list:
    """Every step's logits for a small chunked, mixed prefill/decode workload."""
    engine = chunked_engine(arch, fast_forward=fast)
    assert (engine.runner.forward.lean is not None) == fast
    return step_logits(engine, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_lean_forward_logits_equal_the_hf_forward_bit_for_bit(arch):
    hf, lean = greedy_step_logits(arch, fast=False), greedy_step_logits(arch, fast=True)
    assert len(hf) == len(lean) > 5
    for a, b in zip(hf, lean):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["gpt2", "gemma2"])
def test_other_architectures_keep_the_hf_forward(arch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir(arch)))
    assert FastForward.for_model(model) is None


@pytest.mark.parametrize(
    "layout, gemm",
    [("onednn", "mkldnn::_linear_pointwise"), ("auto", "slipstream_cpu::small_gemm")],
)
def test_lean_forward_runs_four_gemms_per_layer(layout, gemm):
    """q/k/v and gate/up each run as one GEMM (fused only where that is bit for bit the
    layers' own product, so this also checks that): 4 a layer (qkv, o, gate-up, down) plus
    the LM head, against 7 a layer in the Hugging Face forward. With ``auto`` these few-row
    steps run the small-GEMM kernel."""
    from slipstream.worker import kernels
    from slipstream.worker.layers.linear import onednn_available

    if not onednn_available():
        pytest.skip("oneDNN linear unavailable in this torch build")
    if layout == "auto" and not kernels.load():
        pytest.skip(f"no CPU kernel: {kernels.unavailable_reason()}")

    def gemms_per_step(fast: bool) -> int:
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_model_dir("llama")),
                block_size=4,
                max_model_len=64,
                num_gpu_blocks_override=40,
                cpu_linear=layout,
                fast_forward=fast,
            )
        )
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1))  # warm
        with torch.profiler.profile() as prof:
            engine.generate([[4, 5, 6]], SamplingParams(max_tokens=1, temperature=0))
        return sum(e.count for e in prof.key_averages() if e.key == gemm)

    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(str(tiny_model_dir("llama"))).num_hidden_layers
    assert gemms_per_step(fast=True) == 4 * layers + 1
    assert gemms_per_step(fast=False) == 7 * layers + 1


@pytest.mark.parametrize("fuse", [True, False])
def test_the_last_layer_finishes_only_the_rows_that_give_logits(fuse):
    """A prompt's other rows need only their K/V from the last layer: its o-projection and
    MLP run on the sampled rows alone, unless the projections are LoRA-wrapped (fuse=False:
    adapters find their rows by position), where every row goes through."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("llama")))
    fast = FastForward.for_model(model, fuse=fuse)
    seen = {}

    def rows_into(index):
        def hook(module, args):
            seen.setdefault(index, args[0].shape[1])  # x: [1, rows, intermediate]

        return hook

    for layer in (fast.layers[0], fast.layers[-1]):
        layer.down.register_forward_pre_hook(rows_into(layer.index))

    def attend(index, q, k, v, scaling, window):  # causal attention within the one prompt
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scaling
        )
        return out.transpose(0, 1)

    ids = torch.randint(0, model.config.vocab_size, (12,))
    keep = torch.tensor([5, 11])
    with torch.no_grad():
        logits = fast.logits(fast.hidden_states(ids, torch.arange(12), keep, attend))
        want = model(ids[None]).logits[0, keep]
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert seen == {0: 12, fast.layers[-1].index: 2 if fuse else 12}


@pytest.mark.parametrize("tied", [False, True])
def test_fp32_linears_are_held_only_in_their_packed_copies(tmp_path, tied):
    """With the lean forward's products on packed (and stacked) copies, a linear's stock
    weight is read by nothing: it goes. A tied head's table goes too where the embedding
    looks its rows up in the head's packed copy (``auto`` on the kernel); with oneDNN's
    packing, which cannot be gathered, the embedding keeps it. The engine still answers as
    the Hugging Face model does."""
    from slipstream.worker.layers.linear import kernel_serves_fp32
    from support import drop_checkpoint_tensor, hf_greedy, tiny_llama_variant

    path = tiny_model_dir("llama")
    if tied:
        path = tiny_llama_variant(tmp_path / "tied", tie_word_embeddings=True)
        drop_checkpoint_tensor(path, "lm_head.weight")
    engine = LLMEngine(EngineConfig(model=str(path), num_gpu_blocks_override=64))
    head = engine.model.lm_head
    linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 2 * 7 + 1
    assert all(m.weight.is_meta for m in linears if m is not head)
    table_dropped = not tied or kernel_serves_fp32()
    assert head.weight.is_meta == table_dropped
    assert engine.model.get_input_embeddings().weight.is_meta == (tied and table_dropped)
    prompt = [5, 17, 300, 42, 7]
    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(path, prompt, 8)


def test_the_projections_loras_wrap_keep_their_stock_weights():
    from slipstream.worker.layers.linear import prepare_linears
    from slipstream.worker.model.loader import load_model

    model = load_model(tiny_model_dir("llama"), torch.float32, torch.device("cpu"), lean=True)
    prepare_linears(model, "auto")
    fast = FastForward.for_model(model, fuse=False)
    assert fast is not None and fast.packed_only() == []
