"""CPU linear layouts: every layout computes the stock product (to float rounding)."""

import ctypes
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from slipstream.worker.layers.linear import (
    CpuLinear,
    bucketed_rows,
    onednn_available,
    padded_product,
    prepare_linears,
)


def _model(bias: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(96, 200, bias=bias), torch.nn.Linear(200, 40))


@pytest.mark.parametrize("layout", ["auto", "onednn", "transposed", "stock"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_every_layout_computes_the_stock_product(layout, rows):
    model = _model(bias=rows % 2 == 1)
    x = torch.randn(1, rows, 96)
    with torch.no_grad():
        want = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight, model[1].bias)
        applied = prepare_linears(model, layout)
        got = model(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert applied.value == layout or (layout in ("auto", "onednn") and not onednn_available())


def test_onednn_layout_runs_packed_weights():
    if not onednn_available():
        pytest.skip("torch built without oneDNN")
    model = _model(bias=True)
    assert prepare_linears(model, "onednn") is CpuLinear.ONEDNN
    assert all("forward" in vars(m) for m in model)  # the packed product replaced forward
    with pytest.raises(ValueError):
        prepare_linears(model, "mkl")


def test_row_counts_run_at_forty_shapes_with_under_16_rows_or_an_eighth_of_padding():
    shapes = {bucketed_rows(rows) for rows in range(1, 2049)}
    assert len(shapes) == 40
    for rows in range(1, 2049):
        padded = bucketed_rows(rows)
        assert 0 <= padded - rows < max(16, rows / 8), rows


def _heap_mb() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_a_packed_layer_over_hundreds_of_row_counts_keeps_its_heap_small():
    """oneDNN caches a compiled primitive per product shape (~0.5 MB each here): run at every
    row count, 600 prompt lengths grew the heap by ~350 MB (the server's per-wave growth)."""
    if not onednn_available():
        pytest.skip("torch built without oneDNN")
    torch.manual_seed(0)
    layer = torch.nn.Linear(576, 1536, bias=False)
    prepare_linears(layer, "onednn")
    with torch.no_grad():
        layer(torch.randn(300, 576))  # the first call's one-off allocations
        before = _heap_mb()
        for rows in range(65, 665):
            layer(torch.randn(rows, 576))
    assert _heap_mb() - before < 60


@pytest.mark.parametrize("rows", [65, 129, 1000])
def test_padded_rows_leave_the_real_rows_unchanged(rows):
    if not onednn_available():
        pytest.skip("torch built without oneDNN")
    model = _model(bias=True)
    x = torch.randn(rows, 96)
    with torch.no_grad():
        want = model[1](model[0](x))
        prepare_linears(model, "onednn")
        got = model(x)
    assert got.shape == (rows, 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_padded_products_stage_into_one_reused_buffer_and_slice_the_padding_off():
    """A padded input is converted and padded in one pass into a per-width buffer that is
    reused (no fresh padded copy per product); the rows past the input are zeros."""
    from slipstream.worker.layers import linear as cpu_linear

    torch.manual_seed(0)
    w = torch.randn(40, 24)
    seen = []

    def product(rows):
        seen.append((rows.data_ptr(), rows.shape[0], rows[-1].abs().sum().item()))
        return rows.float() @ w.t()

    for rows in (130, 129, 200, 1000, 130):  # buckets 144, 144, 208, 1024, 144
        x = torch.randn(rows, 24)
        with torch.inference_mode(rows % 2 == 0):  # made in inference mode, used outside too
            got = padded_product(x, product, torch.bfloat16)
        assert got.shape == (rows, 40)
        torch.testing.assert_close(got, x.bfloat16().float() @ w.t())
    assert [s[1] for s in seen] == [144, 144, 208, 1024, 144]
    assert all(s[2] == 0 for s in seen)  # padding rows are zeros
    assert len({s[0] for s in seen[:3] + seen[4:]}) == 1  # one buffer for decode-sized rows
    assert cpu_linear._staging.bufs[(24, torch.bfloat16, True)].shape == (256, 24)
    assert cpu_linear._staging.bufs[(24, torch.bfloat16, False)].shape == (2048, 24)
