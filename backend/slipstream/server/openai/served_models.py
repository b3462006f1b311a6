"""What the OpenAI frontend knows of each model Triton serves: the names a client may put in
``model`` (the Triton model, and each of its LoRA adapters), the tokenizer whose chat template
renders ``messages``, and ``max_model_len`` (the default output budget, as vLLM's).

Read from the same rendered model repository ``slipstream serve`` hands to Triton, so the
frontend and the models agree without asking the models anything at request time.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

DEFAULT_MAX_MODEL_LEN = 2048


@dataclass
class ServedModel:
    """One Triton model served by the slipstream backend."""

    name: str  # the Triton model name
    tokenizer_source: str  # a Hugging Face directory ("default": the embedded model)
    max_model_len: int
    lora_names: list[str] = field(default_factory=list)
    # The names clients use (--served-model-name; the first is the one reported); empty:
    # the Triton model name.
    served_names: list[str] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _tokenizer: object = field(default=None, repr=False)

    @property
    def openai_id(self) -> str:
        return self.served_names[0] if self.served_names else self.name

    @property
    def tokenizer(self):
        """Loaded on first use (a chat request), once."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.tokenizer_source)
            return self._tokenizer


@dataclass(frozen=True)
class Target:
    """Where a request's ``model`` goes: a Triton model, with a LoRA adapter or not."""

    model: ServedModel
    lora_name: Optional[str] = None

    @property
    def id(self) -> str:
        return self.lora_name or self.model.openai_id


class ModelTable:
    """OpenAI model ids -> targets. A LoRA adapter is addressed by its own name (vLLM's rule);
    a name both a model and an adapter elsewhere resolves to the model."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        self.models = list(models)
        self._targets: dict[str, Target] = {}
        for m in self.models:
            for name in m.lora_names:
                self._targets.setdefault(name, Target(m, name))
        for m in self.models:
            for name in m.served_names or [m.name]:
                self._targets[name] = Target(m)

    def resolve(self, name: str) -> Optional[Target]:
        return self._targets.get(name)

    def targets(self) -> list[Target]:
        """What ``/v1/models`` lists: each model once (under its first served name) and each
        of its adapters."""
        adapters = [t for t in self._targets.values() if t.lora_name is not None]
        return [Target(m) for m in self.models] + adapters


def load_tokenizer(source: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_model_dir(source)))


def _model_dir(source: str) -> Path:
    from slipstream.worker.model.loader import resolve_model_path

    return resolve_model_path(source)


@functools.lru_cache(maxsize=None)
def _position_limit(source: str) -> Optional[int]:
    from transformers import AutoConfig

    from slipstream.worker.model.context_length import position_limit

    return position_limit(AutoConfig.from_pretrained(str(_model_dir(source))))


def served_models(
    repo: Path, aliases: Sequence[str] = (), served_names: Sequence[str] = ()
) -> list[ServedModel]:
    """The repository's Slipstream models with their engine settings (checked as the launcher
    checks them). ``served_names`` (vLLM's ``--served-model-name``) name the one model a
    repository serves; with several models each keeps its directory's name."""
    from slipstream import EngineConfig
    from slipstream.server.launch.repository import check_models, find_models

    out = []
    for name, settings in check_models(find_models(repo, aliases)).items():
        config = EngineConfig.from_dict(settings.engine)
        model = str(settings.engine.get("model") or "default")
        limit = config.max_model_len or _position_limit(model) or DEFAULT_MAX_MODEL_LEN
        loras = sorted(config.lora_modules) if config.enable_lora else []
        tokenizer = str(settings.engine.get("tokenizer") or model)
        out.append(ServedModel(name, tokenizer, int(limit), loras))
    if served_names:
        if len(out) != 1:
            raise ValueError(
                f"--served-model-name names one model, but the repository serves {len(out)} "
                f"({', '.join(m.name for m in out)}); each is served by its directory's name"
            )
        out[0].served_names = list(served_names)
    return out
