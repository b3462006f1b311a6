"""bf16 / int8 linear weights on CPU: the compiled bf16 weight-GEMM kernel (both of its paths),
and ``prepare_reduced_linears``: one resident copy of each weight, products close to fp32's.
(The int8 product itself: test_cpu_q8_gemm.py.)"""

import pytest
import torch

from slipstream.worker import kernels
from slipstream.worker.kernels.cpu_features import CpuFeatures
from slipstream.worker.layers import reduced_linear as rl
from slipstream.worker.layers.quantization import int8 as q8_weight

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"no CPU kernel: {kernels.unavailable_reason()}"
)
op = torch.ops.slipstream_cpu


@pytest.fixture(params=["native", "portable"])
def kernel_path(request):
    """Each test on the path this CPU runs, and on the portable one (CPUs without BF16)."""
    op.weight_gemm_force_portable(request.param == "portable")
    yield op.weight_gemm_path()
    op.weight_gemm_force_portable(False)


def _reference(x: torch.Tensor, weight: torch.Tensor, path: str) -> torch.Tensor:
    # The BF16 path rounds x to bf16 once; the portable one keeps it fp32.
    xr = x.bfloat16().double() if path == "avx512_bf16" else x.double()
    return xr @ weight.double().t()


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64])  # below, at and past the row tile
@pytest.mark.parametrize("n", [1, 4, 37])  # one column, a whole tile, a ragged tail
def test_weight_gemm_computes_the_bf16_product(kernel_path, rows, n):
    gen = torch.Generator().manual_seed(rows * 100 + n)
    x, w = torch.randn(rows, 96, generator=gen), torch.randn(n, 96, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen)
    got = op.weight_gemm(x, w, bias)
    torch.testing.assert_close(
        got.double(), _reference(x, w, kernel_path) + bias.double(), rtol=1e-5, atol=1e-4
    )


def test_weight_gemm_reads_rows_at_their_stride(kernel_path):
    wide, w = torch.randn(3, 128), torch.randn(8, 64).bfloat16()
    x = wide[:, :64]
    torch.testing.assert_close(
        op.weight_gemm(x, w, None).double(),
        _reference(x, w, kernel_path),
        rtol=1e-5,
        atol=1e-4,
    )


def test_weight_gemm_refuses_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op.weight_gemm(torch.randn(1, 40), torch.randn(4, 40).bfloat16(), None)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        op.weight_gemm(torch.randn(1, 32), torch.zeros(4, 32, dtype=torch.int8), None)


class _Tiny(torch.nn.Module):
    """An embedding tied to its head, two linears sharing an input, one with a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 64)
        self.a = torch.nn.Linear(64, 96, bias=True)
        self.b = torch.nn.Linear(64, 32, bias=False)
        self.lm_head = torch.nn.Linear(64, 50, bias=False)
        self.lm_head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed


@pytest.mark.parametrize("fmt, tol", [("bfloat16", 0.02), ("int8", 0.03)])
@pytest.mark.parametrize("rows", [1, 3, 40])  # the kernel's rows and oneDNN's
def test_prepared_layers_keep_one_copy_and_compute_near_fp32(fmt, tol, rows):
    torch.manual_seed(0)
    model = _Tiny()
    ids = torch.randint(0, 50, (rows,))
    with torch.no_grad():
        h = model.embed(ids)
        want = [model.a(h), model.b(h), model.lm_head(h)]
        rl.prepare_reduced_linears(model, rl.WeightFormat(fmt))
        got_h = model.embed(ids)
        got = [model.a(got_h), model.b(got_h), model.lm_head(got_h)]
    # the fp32 weights are gone: every parameter is a storage-less stand-in
    assert all(p.device.type == "meta" for p in model.parameters())
    assert got_h.dtype == torch.float32
    torch.testing.assert_close(got_h, h, atol=tol * h.abs().max().item(), rtol=0)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert (g - w).abs().max() <= tol * w.abs().max() + 1e-3


def test_int8_head_is_the_only_copy_and_the_tied_embedding_reads_it():
    """quantization=int8 quantizes the head too; the embedding tied to it looks its rows up
    in the head's packed blocks (no table of its own)."""
    torch.manual_seed(0)
    model = _Tiny()
    ids = torch.randint(0, 50, (5,))
    with torch.no_grad():
        h = model.embed(ids)
        want = model.lm_head(h)
        rl.prepare_reduced_linears(model, rl.WeightFormat.INT8)
        head = rl.applied_plan(model.lm_head)
        got_h = model.embed(ids)
        got = model.lm_head(got_h)
    assert head is not None and head.q8 is not None and head.plain is None
    assert model.embed.weight.device.type == "meta"  # no table of its own
    torch.testing.assert_close(got_h, head.q8.rows(ids))
    assert (got_h - h).abs().max() <= 0.01 * h.abs().max()
    assert (got - want).abs().max() <= 0.03 * want.abs().max()


def test_bf16_tied_embedding_reads_the_bf16_table():
    """The embedding tied to a bf16 head returns the head's rows rounded to bf16, widened to
    fp32 (a plain bf16 table: oneDNN's packing of the head cannot be gathered)."""
    torch.manual_seed(0)
    model = _Tiny()
    want = model.embed.weight.detach().bfloat16().float()
    ids = torch.tensor([3, 7, 3])
    with torch.no_grad():
        rl.prepare_reduced_linears(model, rl.WeightFormat.BFLOAT16)
        rows = model.embed(ids)
    assert rl.applied_plan(model.lm_head).q8 is None
    assert rows.dtype == torch.float32 and torch.equal(rows, want[ids])


@pytest.mark.parametrize("fmt", [rl.WeightFormat.INT8, rl.WeightFormat.BFLOAT16])
def test_an_embedding_with_a_forward_of_its_own_keeps_it_and_its_table(fmt):
    """Gemma's embedding scales its rows: it keeps its own table and forward; the head is
    still reduced."""
    from support import ScaledEmbedding, TiedLM

    torch.manual_seed(3)
    model = TiedLM(ScaledEmbedding)
    ids = torch.tensor([0, 2, 15, 69])
    with torch.no_grad():
        want = model.embed(ids)
        rl.prepare_reduced_linears(model, fmt)
        assert not model.embed.weight.is_meta
        assert torch.equal(model.embed(ids), want)
    assert rl.applied_plan(model.lm_head) is not None


def test_fused_layers_compute_each_layers_product():
    torch.manual_seed(0)
    model = _Tiny()
    rl.prepare_reduced_linears(model, rl.WeightFormat.INT8)
    x = torch.randn(2, 64)
    with torch.no_grad():
        separate = [model.a(x), model.b(x)]
        fused = rl.fused_reduced([model.a, model.b])
        a, b = fused(x).split([96, 32], dim=-1)
    assert rl.applied_plan(model.a) is None  # the layer's own plan, and its copy, are gone
    torch.testing.assert_close(a, separate[0])
    torch.testing.assert_close(b, separate[1])
    torch.testing.assert_close(model.a(x), separate[0])  # still callable: a slice of the fused


@pytest.mark.parametrize(
    "settings, weights, kv",
    [
        # the KV cache follows the model's dtype (vLLM's auto): bf16 with reduced weights
        (dict(dtype="bfloat16"), "bfloat16", torch.bfloat16),
        (dict(dtype="float16"), "bfloat16", torch.bfloat16),  # held as bf16 on CPU
        (dict(quantization="int8"), "int8", torch.bfloat16),
        (dict(dtype="bfloat16", kv_cache_dtype="float32"), "bfloat16", torch.float32),
    ],
)
def test_engine_serves_with_reduced_weights_and_fp32_activations(settings, weights, kv, caplog):
    import logging

    from slipstream import EngineConfig, SamplingParams
    from slipstream.engine import LLMEngine
    from support import tiny_model_dir

    with caplog.at_level(logging.INFO, logger="slipstream"):
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_model_dir("llama")),
                block_size=4,
                max_num_seqs=4,
                max_model_len=128,
                num_gpu_blocks_override=64,
                device="cpu",
                **settings,
            )
        )
    # the start-up log says which path runs the products, and the CPU features it found
    assert any(
        "CPU linear layers:" in r.message and "amx_bf16=" in r.message for r in caplog.records
    )
    assert engine.weight_format == weights and engine.dtype == torch.float32
    assert engine.kv_cache.data.dtype == kv
    plans = [rl.applied_plan(m) for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    assert rl.applied_plan(engine.model.lm_head) is not None and len(plans) > 1
    outs = engine.generate(
        ["hello there", "one two three four"],
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    )
    assert [len(o.token_ids) for o in outs] == [6, 6]


def test_reduced_weights_are_refused_on_cuda_and_named_in_model_json():
    from slipstream import EngineConfig
    from slipstream.server.stub.engine_arg_reader import translate
    from slipstream.worker.device import resolve_weight_format

    with pytest.raises(ValueError, match="CPU only"):
        resolve_weight_format(EngineConfig(quantization="int8"), torch.device("cuda"))
    args = translate({"dtype": "bfloat16", "quantization": "int8", "kv_cache_dtype": "bfloat16"})
    assert args.engine == {
        "dtype": "bfloat16",
        "quantization": "int8",
        "kv_cache_dtype": "bfloat16",
    }
    with pytest.raises(ValueError, match="quantization='fp8' is not supported"):
        translate({"quantization": "fp8"})
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")


def test_a_cpu_without_bf16_or_amx_takes_the_portable_bf16_paths(monkeypatch):
    """As on an AVX2-only CPU: decode rows on the portable kernel, prompt rows in fp32 on a
    widened copy (oneDNN would only emulate bf16 there); the log line says so."""
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls: cls(False, False, False)))
    op.weight_gemm_force_portable(True)
    try:
        torch.manual_seed(0)
        model = _Tiny()
        x_few, x_many = torch.randn(2, 64), torch.randn(40, 64)
        with torch.no_grad():
            want = [model.a(x_few), model.a(x_many)]
            how = rl.prepare_reduced_linears(model, rl.WeightFormat.BFLOAT16)
            plan = rl.applied_plan(model.a)
            got = [model.a(x_few), model.a(x_many)]
    finally:
        op.weight_gemm_force_portable(False)
    assert "portable" in how and "no AVX512-BF16 or AMX" in how
    assert plan.packed is None and not plan.pack and not plan.bf16_gemm
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= 0.03 * w.abs().max()


def test_a_cpu_without_vnni_runs_int8_on_the_portable_kernel():
    """The same blocks and sums on the portable loop; the log line names the path."""
    op.q8_gemm_force_portable(True)
    try:
        torch.manual_seed(0)
        model = _Tiny()
        x = torch.randn(7, 64)
        with torch.no_grad():
            want = model.a(x)
            how = rl.prepare_reduced_linears(model, rl.WeightFormat.INT8)
            got = model.a(x)
    finally:
        op.q8_gemm_force_portable(False)
    assert "compiled kernel (portable)" in how
    plan = rl.applied_plan(model.a)
    assert plan is not None and plan.q8 is not None
    torch.testing.assert_close(got, q8_weight.product(plan.q8, x, plan.bias, kernel=False))
    assert (got - want).abs().max() <= 0.03 * want.abs().max()


def test_avx512_bf16_without_amx_holds_panels_and_the_embedding_reads_the_heads(monkeypatch):
    """Zen 4 / Cooper Lake: every bf16 weight in panels (the only copy), the tied embedding
    reading the head's panels, products on the panel kernel (portable where this CPU lacks
    AVX512-BF16)."""
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls: cls(True, False, False)))
    torch.manual_seed(0)
    model = _Tiny()
    ids = torch.tensor([4, 9])
    x = torch.randn(3, 64)
    with torch.no_grad():
        want_rows = model.embed.weight.detach().bfloat16().float()[ids]
        want = model.a(x)
        how = rl.prepare_reduced_linears(model, rl.WeightFormat.BFLOAT16)
        got = model.a(x)
        rows = model.embed(ids)
    assert "bf16 weights in panels" in how
    head, a = rl.applied_plan(model.lm_head), rl.applied_plan(model.a)
    assert head is not None and head.panels is not None and head.plain is None
    assert a is not None and a.panels is not None and a.packed is None
    assert model.embed.weight.device.type == "meta" and torch.equal(rows, want_rows)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
