"""What only a GPU can show, run by the cuda tier (``pytest --device cuda``; skipped on CPU):
decode steps that never synchronise but for the one copy back (CUDA's sync debug mode set to
"error" around them), CUDA graphs replaying what eager steps compute, and memory sized from
the device's total as vLLM sizes it."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from slipstream import EngineConfig, SamplingParams
from slipstream.engine import LLMEngine
from slipstream.worker.memory_plan import DEFAULT_GPU_MEMORY_UTILIZATION
from support import tier_settings, tiny_model_dir

PROMPTS = [[5, 17, 300, 42, 9, 1200, 7], [88, 3, 64], list(range(100, 180))]
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3, logprobs=2, ignore_eos=True),
    SamplingParams(
        max_tokens=24,
        temperature=0.7,
        top_k=20,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        logit_bias={11: 2.0},
        ignore_eos=True,
    ),
]


@pytest.fixture
def cuda(tier_device):
    if tier_device.type != "cuda":
        pytest.skip("the cuda tier (pytest --device cuda)")
    return tier_device


def make_engine(device, **settings) -> LLMEngine:
    config = dict(
        **tier_settings(device),
        model=str(tiny_model_dir("llama")),
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        num_gpu_blocks_override=64,
    )
    config.update(settings)
    return LLMEngine(EngineConfig(**config))


def add_requests(engine: LLMEngine) -> None:
    for prompt, params in zip(PROMPTS, PARAMS):
        engine.add_request(prompt, params)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_decode_steps_never_synchronise_but_for_the_copy_back(cuda, graphs):
    engine = make_engine(cuda, enable_cuda_graphs=graphs)
    add_requests(engine)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()  # the prompts, outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            assert engine.step()  # raises on any synchronisation but the designated copy
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_prefill_and_mixed_steps_never_synchronise_but_for_the_copy_back(cuda):
    engine = make_engine(cuda)
    # first steps outside the check: lazy initialisation (cuBLAS handles, Triton's compiles)
    engine.generate(PROMPTS, PARAMS)
    add_requests(engine)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_cuda_graph_steps_give_the_eager_steps_tokens(cuda):
    outputs = []
    for graphs in (True, False):
        engine = make_engine(cuda, enable_cuda_graphs=graphs)
        assert (engine.runner.graphs is not None) == graphs
        results = engine.generate(PROMPTS, PARAMS)
        outputs.append([r.token_ids for r in results])
    assert outputs[0] == outputs[1]


def test_memory_is_sized_from_total_memory_as_vllm_sizes_it(cuda, caplog):
    gc.collect()
    torch.cuda.empty_cache()
    _free, total = torch.cuda.mem_get_info(cuda)
    before = torch.cuda.memory_reserved(cuda)  # other tests' engines
    caplog.set_level(logging.INFO, logger="slipstream")
    engine = make_engine(cuda, num_gpu_blocks_override=None, gpu_memory_utilization=0.3)
    plan = engine.memory_plan
    assert plan is not None and plan.budget == int(total * 0.3)
    assert plan.num_blocks == engine.kv_cache.num_blocks
    assert plan.figures.weights > 0 and plan.figures.activations > 0
    assert plan.figures.cuda_graphs > 0  # graphs on by default
    message = "\n".join(r.getMessage() for r in caplog.records)
    assert "GPU memory: total" in message and "x gpu_memory_utilization 0.3" in message
    # the engine, its cache and its graphs stay within the share (a margin for rounding)
    assert torch.cuda.memory_reserved(cuda) - before <= plan.budget + 2**28
    assert engine.generate([PROMPTS[0]], PARAMS[0])[0].token_ids
    assert DEFAULT_GPU_MEMORY_UTILIZATION == 0.9
