"""CPU linear layouts: every layout computes the stock product (to float rounding)."""
import pytest
import torch
import torch.nn.functional as F

from slipstream.worker.cpu_linear import CpuLinear, onednn_available, prepare_linears


def _model(bias: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(96, 200, bias=bias), torch.nn.Linear(200, 40))


@pytest.mark.parametrize("layout", ["auto", "onednn", "transposed", "stock"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_every_layout_computes_the_stock_product(layout, rows):
    model = _model(bias=rows % 2 == 1)
    x = torch.randn(1, rows, 96)
    with torch.no_grad():
        want = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight,
                        model[1].bias)
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
