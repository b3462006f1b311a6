"""The quality gate of reduced-precision weights: the CPU engine serving with ``dtype=bfloat16``,
``quantization=int8`` or, for a model converted from a GGUF file (the embedded one),
``quantization=gguf`` (its own 4-bit blocks as they ship) against the Hugging Face fp32 model.

For ``gguf`` the fp32 reference is the file's own weights dequantized (the conversion), so the
figures measure what serving the blocks as they are adds: the int8 activation blocks.

Three figures, each on fixed inputs shipped here:

* greedy agreement: for each prompt of ``PROMPTS``, the tokens the candidate generates greedily
  that match the reference's up to their first divergence, over all tokens generated;
* mean KL divergence (nats) of the candidate's next-token distribution from the reference's,
  over every position of ``quality_text.txt`` (written for this project; public domain);
* perplexity on that text, and its change against the reference's.

Gate (``GATES``): perplexity within 0.5% (bf16) / 2% (int8, gguf) of fp32's. The candidate is the
engine itself (``LLMEngine`` with ``dtype`` / ``quantization`` set, everything else as shipped):
its lean forward, prepared layers, compiled kernels and KV cache in the dtype it serves with
(bf16 with reduced weights), so the figures are those of what a server with that setting
answers. The text's log-probabilities are the full rows the engine computes for
``prompt_logprobs``; the greedy tokens are ``LLMEngine.generate``'s.
``slipstream bench --scenario quality`` prints them;
``tests/worker/layers/test_quality_gate.py`` asserts them.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

TEXT = Path(__file__).with_name("quality_text.txt")
PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
    "List three uses of a paperclip:",
    "Translate to French: Good morning, how are you?",
    "The three laws of thermodynamics are",
    "Once upon a time, in a small village,",
)
NEW_TOKENS = 24
# Largest relative perplexity change each weight format may show against fp32.
GATES = {"bfloat16": 0.005, "int8": 0.02, "gguf": 0.02}


@dataclass
class QualityReport:
    weights: str  # bfloat16 / int8 (float32: the reference against itself)
    perplexity: float
    reference_perplexity: float
    perplexity_change: float  # relative: candidate / reference - 1
    mean_kl: float  # nats per token, KL(reference || candidate)
    greedy_agreement: float  # matched tokens up to the first divergence / tokens generated
    first_divergence: list = field(default_factory=list)  # per prompt: index, or None
    gate: Optional[float] = None
    passed: Optional[bool] = None
    seconds: float = 0.0


def load_fp32(path: Path):
    from slipstream.worker.model.loader import load_model

    return load_model(path, torch.float32, torch.device("cpu"))


@torch.no_grad()
def text_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the next token at every position of ``ids`` [T]: [T-1, vocab]."""
    logits = model(input_ids=ids[None]).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def perplexity(log_probs: torch.Tensor, ids: torch.Tensor) -> float:
    picked = log_probs.gather(1, ids[1:, None]).squeeze(1)
    return float(torch.exp(-picked.mean()))


def mean_kl(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    return float((reference.exp() * (reference - candidate)).sum(-1).mean())


@torch.no_grad()
def greedy(model, tokenizer, prompts: Sequence[str], new_tokens: int) -> list[list[int]]:
    outs = []
    for prompt in prompts:  # one at a time: no padding in the way of the comparison
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        gen = model.generate(
            ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
        outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


def agreement(reference: list[list[int]], candidate: list[list[int]]) -> tuple[float, list]:
    matched, total, firsts = 0, 0, []
    for ref, cand in zip(reference, candidate):
        first = next((i for i, (a, b) in enumerate(zip(ref, cand)) if a != b), None)
        if first is None and len(ref) != len(cand):
            first = min(len(ref), len(cand))
        matched += len(ref) if first is None else first
        total += len(ref)
        firsts.append(first)
    return matched / max(total, 1), firsts


@dataclass
class Reference:
    """The fp32 model's figures, computed once for every candidate."""

    ids: torch.Tensor
    log_probs: torch.Tensor
    greedy: list[list[int]]

    @property
    def perplexity(self) -> float:
        return perplexity(self.log_probs, self.ids)


def reference(
    path: Path, tokenizer, prompts: Sequence[str] = PROMPTS, new_tokens: int = NEW_TOKENS
) -> Reference:
    model = load_fp32(path)
    ids = tokenizer(TEXT.read_text(), return_tensors="pt").input_ids[0]
    ref = Reference(ids, text_log_probs(model, ids), greedy(model, tokenizer, prompts, new_tokens))
    del model
    return ref


# The engine settings of each candidate (as `--set` names them).
CANDIDATES = {
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "gguf": {"quantization": "gguf"},
}


def candidate_model(path: Path, weights: str) -> str:
    """What the candidate engine loads: the converted directory, or for ``gguf`` the GGUF
    file it was converted from (named in its ``.complete`` marker)."""
    if weights != "gguf":
        return str(path)
    marker = path / ".complete"
    source = json.loads(marker.read_text()).get("source") if marker.exists() else None
    if not source:
        raise ValueError(f"the gguf candidate needs a model converted from a GGUF file: {path}")
    return str(source)


def candidate_engine(path: Path, weights: str, max_model_len: int):
    from slipstream.core.config import EngineConfig
    from slipstream.engine import LLMEngine

    settings = {**CANDIDATES.get(weights, {}), "enable_prefix_caching": False}
    return LLMEngine(
        EngineConfig(
            model=candidate_model(path, weights),
            tokenizer=str(path),
            device="cpu",
            max_model_len=max_model_len,
            **settings,
        )
    )


@torch.no_grad()
def engine_text_log_probs(engine, ids: torch.Tensor) -> torch.Tensor:
    """What ``text_log_probs`` computes, through the engine: the full logit rows it scores
    ``prompt_logprobs`` with (every chunk of the prompt, in order) -> [T-1, vocab]."""
    from slipstream.core.sampling_params import SamplingParams

    runner, rows = engine.runner, []
    score = runner.execute_with_prompt_logits

    def capture(sched):
        logits, sample_rows, prompt_logits = score(sched)
        rows.extend(p.clone() for p in prompt_logits if p is not None)
        return logits, sample_rows, prompt_logits

    runner.execute_with_prompt_logits = capture
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        engine.generate([ids.tolist()], params)
    finally:
        del runner.execute_with_prompt_logits
    return torch.log_softmax(torch.cat(rows).float(), dim=-1)


def engine_greedy(engine, prompts: Sequence[str], new_tokens: int) -> list[list[int]]:
    from slipstream.core.sampling_params import SamplingParams

    outs = engine.generate(list(prompts), SamplingParams(max_tokens=new_tokens, temperature=0.0))
    return [list(o.token_ids) for o in outs]


def evaluate(
    path: Path,
    tokenizer,
    weights: str,
    ref: Reference,
    prompts: Sequence[str] = PROMPTS,
    new_tokens: int = NEW_TOKENS,
) -> QualityReport:
    start = time.perf_counter()
    engine = candidate_engine(path, weights, max_model_len=len(ref.ids) + 64)
    log_probs = engine_text_log_probs(engine, ref.ids)
    assert log_probs.shape == ref.log_probs.shape, (log_probs.shape, ref.log_probs.shape)
    ppl = perplexity(log_probs, ref.ids)
    agree, firsts = agreement(ref.greedy, engine_greedy(engine, prompts, new_tokens))
    gate = GATES.get(weights)
    change = ppl / ref.perplexity - 1
    return QualityReport(
        weights,
        ppl,
        ref.perplexity,
        change,
        mean_kl(ref.log_probs, log_probs),
        agree,
        firsts,
        gate,
        None if gate is None else abs(change) <= gate,
        time.perf_counter() - start,
    )


def format_table(reports: Sequence[QualityReport]) -> str:
    lines = [
        f"{'weights':<9} {'perplexity':>10} {'vs fp32':>8} {'gate':>6} {'mean KL':>9} "
        f"{'greedy agree':>12}  first divergence per prompt"
    ]
    for r in reports:
        gate = "-" if r.gate is None else f"{r.gate:.1%}"
        verdict = "" if r.passed is None else (" ok" if r.passed else " FAIL")
        lines.append(
            f"{r.weights:<9} {r.perplexity:>10.4f} {r.perplexity_change:>+8.3%} "
            f"{gate:>6} {r.mean_kl:>9.5f} {r.greedy_agreement:>12.1%}  "
            f"{r.first_divergence}{verdict}"
        )
    return "\n".join(lines)


def run_quality(model: str, weights: Sequence[str], output_dir: Optional[Path]) -> int:
    """``slipstream bench --scenario quality``: the table, and quality.json; 1 if a gate fails."""
    from slipstream.worker.model.loader import load_tokenizer, resolve_model_path

    path = resolve_model_path(model)
    tokenizer = load_tokenizer(path)
    ref = reference(path, tokenizer)
    reports = [
        QualityReport(
            "float32", ref.perplexity, ref.perplexity, 0.0, 0.0, 1.0, [None] * len(PROMPTS)
        )
    ]
    reports += [evaluate(path, tokenizer, w, ref) for w in weights]
    print(format_table(reports), flush=True)
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "quality.json").write_text(
            json.dumps({"cpu_flags": _flags(), "reports": [asdict(r) for r in reports]}, indent=2)
        )
    return 0 if all(r.passed is not False for r in reports) else 1


def _flags() -> str:
    from slipstream.worker.kernels.cpu_features import cpu_flags

    return cpu_flags()
