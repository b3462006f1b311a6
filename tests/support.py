"""Shared test helpers: cached tiny models and the Hugging Face greedy reference."""

from __future__ import annotations

import functools
import json
import os
import random
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from slipstream.cache_dir import cache_root
from slipstream.testing import make_tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]  # the repository


@functools.lru_cache(maxsize=None)
def tiny_model_dir(arch: str = "llama") -> Path:
    return make_tiny_model_dir(cache_root() / "test-models" / f"tiny-{arch}", arch)


def tiny_llama_variant(target: Path, **config_changes) -> Path:
    """A copy of the tiny Llama at ``target`` with ``config.json`` fields changed."""
    import shutil

    shutil.copytree(tiny_model_dir("llama"), target)
    raw = json.loads((target / "config.json").read_text())
    raw.update(config_changes)
    (target / "config.json").write_text(json.dumps(raw))
    return target


def drop_checkpoint_tensor(path: Path, name: str) -> None:
    """Remove tensor ``name`` from the model's ``model.safetensors``."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    del weights[name]
    save_file(weights, str(path / "model.safetensors"))


@functools.lru_cache(maxsize=None)
def reference_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_greedy(path: Path, prompt: list, max_tokens: int) -> list:
    """``model.generate`` for one request alone: the ground truth for greedy outputs."""
    model = reference_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


# The samplers an engine test runs with: the CPU one, and the device one (on CPU tensors in the
# cpu tier, with the step's whole GPU protocol; on CUDA in the cuda tier).
SAMPLERS = ("cpu", "device")


def tier_settings(device: torch.device) -> dict:
    """EngineConfig settings of a test-tier engine: on the tier's device, in fp32 (the
    references are fp32)."""
    return {"device": str(device), "dtype": "float32"}


def use_device_path(engine) -> None:
    """Run a CPU ``engine``'s steps through the GPU engine's protocol: the step's inputs in one
    staged upload, the device sampler (staged too), everything read back in one copy."""
    from slipstream.worker.sample.device_sampler import DeviceSampler
    from slipstream.worker.transfer import HostToDevice

    engine.sampler = DeviceSampler(engine.config.seed, staged=True)
    engine.runner.upload = HostToDevice(engine.device, staged=True)
    draft_runner = getattr(engine.proposer, "runner", None)  # the draft model's
    if draft_runner is not None:
        draft_runner.upload = HostToDevice(engine.device, staged=True)


def engine_with_sampler(sampler: str, device: torch.device, make):
    """``make(settings)``'s engine on the tier's ``device`` sampling with ``sampler`` (one of
    ``SAMPLERS``; the CPU sampler is skipped in the cuda tier)."""
    if sampler == "cpu" and device.type != "cpu":
        pytest.skip("the CPU sampler")
    engine = make(tier_settings(device))
    if sampler == "device" and device.type == "cpu":
        use_device_path(engine)
    return engine


def tiny_engine_config(**overrides):
    """The tiny llama's engine settings most engine tests use (4-token blocks, 8 sequences,
    256-token context, a fixed pool of 300 blocks); ``overrides``: more EngineConfig."""
    from slipstream import EngineConfig

    settings = dict(
        model=str(tiny_model_dir("llama")),
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=256,
        num_gpu_blocks_override=300,
    )
    return EngineConfig(**{**settings, **overrides})


def chunked_engine(arch: str, **settings):
    """An engine on the tiny ``arch`` whose steps chunk prompts and mix them with decode rows
    (48-token steps, 4-token blocks), for ``step_logits``; ``settings``: more EngineConfig
    (``model``: another checkpoint of that shape)."""
    from slipstream import EngineConfig
    from slipstream.engine import LLMEngine

    settings.setdefault("model", str(tiny_model_dir(arch)))
    return LLMEngine(
        EngineConfig(
            block_size=4,
            max_num_batched_tokens=48,
            max_num_seqs=8,
            max_model_len=256,
            num_gpu_blocks_override=300,
            **settings,
        )
    )


def step_logits(engine, params) -> list:
    """Every step's logits while ``engine`` generates five prompts of 1-90 tokens."""
    prompts, _ = random_workload(5, seed=3, lengths=(3, 40, 17, 90, 1))
    logits: list = []
    run = engine.runner.run
    engine.runner.run = lambda batch: logits.append(run(batch)) or logits[-1]
    engine.generate(prompts, params)
    return logits


def stack_and_loop_logits(make_engine, params) -> tuple[list, list, int]:
    """Every step's logits of ``step_logits``' workload on two engines ``make_engine()``
    builds: one with its compiled decode stack taken away (the Python loop runs every layer),
    one on it; and how many steps ran on the stack. Skips where there is no stack."""
    runs = []
    for stacked in (False, True):
        engine = make_engine()
        fast = engine.runner.forward.lean
        assert fast is not None
        if fast.stack is None:
            pytest.skip("this CPU runs these products without the compiled reduced kernels")
        calls = [0]
        if stacked:
            run = fast.stack.run
            fast.stack.run = lambda *a, **k: calls.__setitem__(0, calls[0] + 1) or run(*a, **k)
        else:
            fast.stack = None
        runs.append((step_logits(engine, params), calls[0]))
    (loop, _), (stack, calls) = runs
    return loop, stack, calls


def random_workload(
    n: int, seed: int = 0, lengths=(1, 2, 5, 17, 40, 64, 130, 300), max_out: int = 24
) -> tuple:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, 40000) for _ in range(lengths[i % len(lengths)])] for i in range(n)
    ]
    outs = [rng.randrange(1, max_out) for _ in range(n)]
    return prompts, outs


def need_tritonserver() -> None:
    """Skip a real-server test where no tritonserver is installed, except in CI, where the
    [server] extra is part of `make install` and its absence is a failure."""
    from slipstream.server.launch.triton_install import find_tritonserver

    try:
        find_tritonserver()
    except Exception as e:  # pragma: no cover - the [server] extra is part of `make install`
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no tritonserver: {e}")


def http_generate(server, model: str, body: dict) -> tuple:
    """POST /v2/models/MODEL/generate: (HTTP status, JSON body), errors included."""
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/generate", data=json.dumps(body).encode()
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class ScaledEmbedding(torch.nn.Embedding):
    """An embedding whose forward scales its rows, as Gemma's does."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 8.0


class TiedLM(torch.nn.Module):
    """An embedding tied to its LM head, the two linears on either side of it."""

    def __init__(self, embedding: type = torch.nn.Embedding) -> None:
        super().__init__()
        self.embed = embedding(70, 64, padding_idx=2)  # a padding_idx as transformers builds it
        self.a = torch.nn.Linear(64, 96, bias=True)
        self.lm_head = torch.nn.Linear(64, 70, bias=False)
        self.lm_head.weight = self.embed.weight

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed
