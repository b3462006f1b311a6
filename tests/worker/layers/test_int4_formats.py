"""4-bit checkpoints' tensors as the kernels read them, without widening a weight: GGUF's
Q4_0 / Q4_1 / Q4_K / Q8_0 blocks (``quantization/gguf.py``) against gguf-py's own
dequantization, AWQ's and GPTQ's packed tensors (``awq.py``, ``gptq.py``) against the weights
their packers (``int4_support``) stand for. Every weight must come out exactly."""

import numpy as np
import pytest
import torch

from slipstream.worker.layers.quantization import awq, gguf as gguf_blocks, gptq, int4, int8
from int4_support import awq_tensors, gptq_tensors, q4_k_blocks


def _random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random blocks of a weight [N, K]: random codes, finite random scales."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if type_name == "Q4_K":
        return q4_k_blocks(n, k, seed)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    return quantize(w.numpy(), GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
@pytest.mark.parametrize("n, k", [(40, 256), (96, 512), (1, 768)])  # ragged last panels
def test_gguf_blocks_hold_the_files_weights_exactly(type_name, n, k):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = _random_blocks(type_name, n, k, seed=n + k)
    layout = gguf_blocks.read(data, type_name, n, k)
    expected = torch.from_numpy(dequantize(data, GGMLQuantizationType[type_name])).reshape(n, k)
    assert isinstance(layout, int8.Q8Weight if type_name == "Q8_0" else int4.Int4Weight)
    assert torch.equal(layout.dequantized(), expected)
    if type_name != "Q8_0":  # 4 bits a weight, and the scales: nothing wider
        assert layout.packed.dtype == torch.uint8 and layout.packed.numel() * 2 >= n * k
        # the file's float16 values stay float16; Q4_K's products of them are float32
        assert layout.scales.dtype == (torch.float32 if type_name == "Q4_K" else torch.float16)


def test_gguf_rows_can_be_reordered_as_whole_rows_of_blocks():
    data = _random_blocks("Q4_1", 64, 128, seed=1)
    rows = torch.randperm(64, generator=torch.Generator().manual_seed(2))
    whole = gguf_blocks.read(data, "Q4_1", 64, 128)
    reordered = gguf_blocks.read(data, "Q4_1", 64, 128, rows)
    assert whole is not None and reordered is not None
    assert torch.equal(reordered.dequantized(), whole.dequantized()[rows])


def test_gguf_types_the_kernels_do_not_read_are_left_to_the_caller():
    assert gguf_blocks.read(np.zeros((4, 64), np.float32), "F32", 4, 64) is None
    with pytest.raises(ValueError, match="not whole blocks"):
        gguf_blocks.read(np.zeros((4, 18), np.uint8), "Q4_0", 4, 48)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n", [64, 40])
def test_awq_tensors_hold_the_weights_exactly(group, n):
    w = torch.randn(n, 256, generator=torch.Generator().manual_seed(group + n))
    tensors, deq = awq_tensors(w, group)
    layout = awq.weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], group)
    assert layout.out_features == n and layout.in_features == 256 and layout.group == group
    assert torch.equal(layout.dequantized(), deq.float())


@pytest.mark.parametrize(
    "options", [{}, {"v2": True}, {"act_order": True}], ids=["gptq", "gptq_v2", "act_order"]
)
def test_gptq_tensors_hold_the_weights_exactly(options):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(3))
    tensors, deq = gptq_tensors(w, 64, **options)
    layout = gptq.weight(
        tensors["qweight"],
        tensors["qzeros"],
        tensors["scales"],
        tensors["g_idx"],
        64,
        0 if options.get("v2") else 1,
    )
    assert torch.equal(layout.dequantized(), deq.float())
    # act-order: the kernel's channels are sorted by group; the others keep their order
    assert (layout.perm is not None) == bool(options.get("act_order"))


def test_gptq_refuses_groups_of_unequal_size():
    w = torch.randn(32, 128)
    tensors, _ = gptq_tensors(w, 64)
    g_idx = torch.zeros(128, dtype=torch.int32)
    g_idx[100:] = 1
    with pytest.raises(ValueError, match="exactly group_size"):
        gptq.weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx, 64)
