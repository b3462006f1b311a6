"""Multi-LoRA in the engine: each request's greedy output equals the PEFT-merged model's run
alone, with several adapters and the base model in the same ragged batch; the limits
(max_loras, max_lora_rank), the prefix cache's separation of adapters, and vLLM's errors."""

from __future__ import annotations

import functools

import pytest

from slipstream import EngineConfig, SamplingParams
from slipstream.core.lora_limit import adapters_of
from slipstream.engine import LLMEngine
from slipstream.worker.lora import layers
from lora_support import adapter_dir, make_adapter, merged_greedy
from support import random_workload, tiny_model_dir

NAMES = [None, "doll", "sheep"]


def lora_engine(**overrides) -> LLMEngine:
    settings = dict(
        model=str(tiny_model_dir()),
        block_size=4,
        max_num_batched_tokens=48,
        max_num_seqs=8,
        max_model_len=512,
        num_gpu_blocks_override=600,
        enable_lora=True,
        max_loras=2,
        lora_modules={n: str(adapter_dir(n)) for n in NAMES if n},
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


@functools.lru_cache(maxsize=None)
def workload() -> tuple:
    """Each prompt under every adapter and the base model, with the merged references."""
    prompts, outs = random_workload(4, seed=3)
    jobs = [(name, p, o) for p, o in zip(prompts, outs) for name in NAMES]
    return jobs, [merged_greedy(name, p, o) for name, p, o in jobs]


def greedy(name, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, lora_name=name)


@pytest.mark.parametrize("fast_forward", [True, False], ids=["lean-forward", "hf-forward"])
def test_mixed_adapters_in_one_batch_match_the_merged_models(fast_forward, monkeypatch):
    jobs, reference = workload()
    # The adapters really change the outputs: the same prompt gives three different answers.
    for i in range(0, len(jobs), 3):
        assert len({tuple(r) for r in reference[i : i + 3]}) == 3
    steps = []
    original = layers.LoraLayers.mapping_for
    monkeypatch.setattr(
        layers.LoraLayers,
        "mapping_for",
        lambda self, spans, device: steps.append(spans) or original(self, spans, device),
    )
    engine = lora_engine(fast_forward=fast_forward)
    results = engine.generate([p for _, p, _ in jobs], [greedy(n, o) for n, _, o in jobs])
    assert [r.token_ids for r in results] == reference
    # Steps held both adapters and base-model requests together.
    assert any({s for s, _, _ in spans} == {None, 0, 1} for spans in steps)
    assert engine.block_manager.num_used_blocks == 0


def test_prefix_cache_never_shares_blocks_between_adapters():
    jobs, reference = workload()
    engine = lora_engine()
    prompt, max_tokens = jobs[-1][1], jobs[-1][2]
    expected = {name: ref for (name, p, _), ref in zip(jobs, reference) if p == prompt}
    cached = {}
    for name in [None, "doll", "doll", "sheep", None]:
        out = engine.generate([prompt], [greedy(name, max_tokens)])[0]
        assert out.token_ids == expected[name], name
        cached.setdefault(name, []).append(out.num_cached_tokens)
    # The same adapter hits its own blocks; another adapter, or the base model, never does.
    assert cached["doll"][0] == 0 and cached["doll"][1] > 0
    assert cached["sheep"] == [0]
    assert cached[None][0] == 0 and cached[None][1] > 0


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_max_loras_defers_requests_whose_adapter_would_exceed_it(batching):
    jobs, reference = workload()
    engine = lora_engine(max_loras=1, batching=batching, max_batch_size=4)
    reqs = [engine.add_request(p, greedy(n, o)) for n, p, o in jobs]
    tokens = {r.request_id: [] for r in reqs}
    most = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
        most = max(most, len(adapters_of(engine.scheduler.running)))
        assert len(adapters_of(engine.scheduler.running)) <= 1
    assert most == 1
    assert [tokens[r.request_id] for r in reqs] == reference


def test_adapter_above_max_lora_rank_is_refused_at_load():
    with pytest.raises(ValueError, match="rank 8 is greater than max_lora_rank 4"):
        lora_engine(max_lora_rank=4)


def test_adapter_on_unsupported_module_is_refused_at_load(tmp_path):
    path = make_adapter(tmp_path / "head", r=2, lora_alpha=2, target_modules=["lm_head"])
    # PEFT saves the (tied) head's own weight too: either is refused by name.
    with pytest.raises(ValueError, match=r"unsupported weight .*lm_head|'lm_head' is not supp"):
        lora_engine(lora_modules={"head": str(path)})


def test_dora_adapter_is_refused_at_load_naming_the_setting(tmp_path):
    path = make_adapter(
        tmp_path / "dora", r=2, lora_alpha=2, target_modules=["q_proj"], use_dora=True
    )
    with pytest.raises(ValueError, match=r"dora: use_dora=True is not supported"):
        lora_engine(lora_modules={"dora": str(path)})


def test_unknown_lora_name_gets_vllms_error_and_lora_off_refuses_any():
    engine = lora_engine()
    with pytest.raises(ValueError) as err:
        engine.add_request([5, 6, 7], greedy("bactrian", 2))
    assert (
        str(err.value) == "LoRA bactrian is not supported, we currently support ['doll', 'sheep']"
    )
    plain = LLMEngine(
        EngineConfig(model=str(tiny_model_dir()), num_gpu_blocks_override=64, max_model_len=128)
    )
    with pytest.raises(ValueError, match="^LoRA feature is not enabled.$"):
        plain.add_request([5, 6, 7], greedy("doll", 2))
    assert engine.get_stats().max_loras == 2 and not engine.has_unfinished()


def test_engine_loop_refuses_an_unknown_adapter_in_the_callers_thread_and_serves_a_known_one():
    from slipstream.engine.loop import EngineLoop

    jobs, reference = workload()
    settings = dict(
        model=str(tiny_model_dir()),
        block_size=4,
        max_model_len=512,
        num_gpu_blocks_override=600,
        enable_lora=True,
        lora_modules={"doll": str(adapter_dir("doll"))},
    )
    with EngineLoop(EngineConfig(**settings)) as loop:
        with pytest.raises(
            ValueError,
            match=r"^LoRA sheep is not supported, we currently "
            r"support \['doll'\]$",
        ):
            loop.submit("a text prompt", greedy("sheep", 2))  # refused before tokenizing
        name, prompt, max_tokens = jobs[1]
        assert name == "doll"
        assert loop.generate(prompt, greedy(name, max_tokens)).token_ids == reference[1]


def test_block_hashes_are_rooted_at_the_adapter():
    from slipstream.core.block_manager import BlockManager
    from slipstream.core.request import Request

    bm = BlockManager(num_blocks=32, block_size=4)
    tokens = list(range(100, 113))

    def run(rid, name):
        r = Request(rid, tokens, SamplingParams(lora_name=name))
        cached = bm.find_cached_prefix(r)
        r.num_computed_tokens = len(cached) * bm.block_size
        bm.allocate(r, r.num_tokens - r.num_computed_tokens, cached)
        r.num_computed_tokens = r.num_tokens
        bm.register_full_blocks(r)
        return len(cached)

    assert run("base", None) == 0
    assert run("doll", "doll") == 0  # the same tokens on an adapter: no hit on base blocks
    assert run("sheep", "sheep") == 0
    assert run("doll-again", "doll") == 3 and run("base-again", None) == 3
    bm.check_invariants()
