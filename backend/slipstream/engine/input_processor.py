"""Turns what a client sent into a ``Request``: every check a request must pass, in one
place, so the engine loop (which checks what it can in the caller's thread) and the
offline engine refuse the same requests with the same messages.

``check`` holds the checks that need no tokenizer (cheap enough for the caller's thread);
``process`` runs them too, then tokenizes, truncates, checks what only token ids tell, and
compiles the grammar of a structured-output request (off the step path).
"""

from __future__ import annotations

import functools
import itertools
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, TypedDict, TypeGuard, Union

from slipstream.core.lora_errors import lora_name_error
from slipstream.core.request import Request
from slipstream.core.sampling_params import SamplingParams
from slipstream.worker.sample.sampler import prepare as prepare_sampling
from slipstream.worker.sample.structured_output import GrammarCompiler

if TYPE_CHECKING:
    from typing_extensions import Unpack

ChatMessage = dict[str, str]  # {"role": ..., "content": ...}
Prompt = Union[str, list[int], list[ChatMessage]]


@dataclass(frozen=True)
class InputLimits:
    """What the built engine can take, fixed once it is built."""

    max_model_len: int
    block_size: int
    num_usable_blocks: int  # KV blocks one sequence may fill
    logits_vocab_size: int  # token ids the model scores (what stop and blocked ids index)
    input_vocab_size: int  # token ids the embedding table holds (what a prompt may use)
    max_num_seqs: int
    continuous_batching: bool  # n / best_of need it
    lora_names: Optional[tuple[str, ...]]  # None: LoRA is off


@dataclass(frozen=True)
class PromptOptions:
    """How a prompt is turned into token ids."""

    apply_chat_template: bool = False  # wrap a text prompt as one user turn
    add_special_tokens: bool = True  # False: the caller's rendered template holds them


class RequestSettings(TypedDict, total=False):
    """A request's settings beside its prompt and sampling parameters, by keyword, each
    defaulting as ``ClientRequest``'s fields do."""

    request_id: Optional[str]  # None: numbered by whoever takes it
    priority: int
    apply_chat_template: bool
    add_special_tokens: bool


@dataclass(frozen=True)
class ClientRequest:
    """What a client asked for, before it is checked and tokenized (``InputProcessor.process``)."""

    prompt: Prompt
    params: SamplingParams
    request_id: Optional[str] = None  # None: the processor numbers it
    priority: int = 0
    options: PromptOptions = PromptOptions()

    @classmethod
    def of(
        cls, prompt: Prompt, params: Optional[SamplingParams], **settings: Unpack[RequestSettings]
    ) -> ClientRequest:
        """What ``LLMEngine.make_request`` and ``EngineLoop.submit`` are asked (no ``params``:
        the defaults)."""
        options = PromptOptions(
            settings.get("apply_chat_template", False), settings.get("add_special_tokens", True)
        )
        return cls(
            prompt,
            params or SamplingParams(),
            settings.get("request_id"),
            settings.get("priority", 0),
            options,
        )


def is_token_ids(prompt: object) -> TypeGuard[Sequence[int]]:
    return bool(prompt) and _all_token_ids(prompt)


def _all_token_ids(prompt: object) -> TypeGuard[Sequence[int]]:
    """A list or tuple of ints (bools excluded), maybe empty."""
    return isinstance(prompt, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    )


def is_chat(prompt: object) -> TypeGuard[Sequence[ChatMessage]]:
    return (
        isinstance(prompt, (list, tuple))
        and bool(prompt)
        and all(isinstance(m, dict) for m in prompt)
    )


def needs_tokenizer(prompt: Prompt) -> bool:
    """Text or chat messages, as opposed to token ids."""
    return isinstance(prompt, str) or is_chat(prompt)


def truncate_prompt(ids: list[int], keep: Optional[int], max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep the last ``keep`` tokens (-1: max_model_len)."""
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:]


class InputProcessor:
    def __init__(
        self, tokenizer, limits: InputLimits, eos_token_id: Optional[int], grammars: GrammarCompiler
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.eos_token_id = eos_token_id
        self.grammars = grammars
        # Requests are tokenized on client threads; the output processor shares the lock.
        self.tokenizer_lock = threading.Lock()
        self._ids = itertools.count()

    # -- the checks ----------------------------------------------------------------------
    def check(self, prompt: Prompt, params: SamplingParams) -> None:
        """What can be refused without tokenizing; raises ``ValueError`` for the client."""
        if prompt == "":
            raise ValueError("the prompt is empty")
        params.check_vocab(self.limits.logits_vocab_size)
        self.check_lora(params.lora_name)
        self.check_prompt_size(prompt)

    def check_lora(self, name: Optional[str]) -> None:
        """vLLM's (vllm_backend's) refusals of an adapter this engine does not serve."""
        error = lora_name_error(name, self.limits.lora_names)
        if error is not None:
            raise ValueError(error)

    @functools.cached_property
    def max_prompt_bytes(self) -> int:
        """Prompts longer than this many UTF-8 bytes cannot fit in ``max_model_len`` tokens:
        no token covers more bytes than the longest in the vocabulary (measured on its
        stored form, which is never shorter than the text it stands for)."""
        longest = max(
            (len(t.encode("utf-8", "replace")) for t in self.tokenizer.get_vocab()), default=1
        )
        return self.limits.max_model_len * max(longest, 1)

    def check_prompt_size(self, prompt: Prompt) -> None:
        """Refuse a text prompt too large to fit before spending time tokenizing it."""
        if isinstance(prompt, str) and len(prompt) > self.max_prompt_bytes // 4:
            size = len(prompt.encode("utf-8", "surrogatepass"))
            if size > self.max_prompt_bytes:
                raise ValueError(
                    f"the prompt is {size} bytes, more than max_model_len "
                    f"{self.limits.max_model_len} tokens can hold (at most "
                    f"{self.max_prompt_bytes} bytes for this tokenizer)"
                )

    def _check_token_ids(self, ids: list[int]) -> None:
        vocab, limit = self.limits.input_vocab_size, self.limits.max_model_len
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {limit} "
                "(prompt plus at least one generated token must fit)"
            )
        blocks, block_size = self.limits.num_usable_blocks, self.limits.block_size
        if -(-(len(ids) + 1) // block_size) > blocks:
            raise ValueError(
                f"the prompt has {len(ids)} tokens and can never fit in the KV "
                f"cache ({blocks} blocks of {block_size})"
            )

    def _check_parallel_sampling(self, params: SamplingParams) -> None:
        k = params.num_sequences
        if k == 1:
            return
        if not self.limits.continuous_batching:
            raise ValueError("n > 1 and best_of > 1 need batching=continuous")
        if k > self.limits.max_num_seqs:
            raise ValueError(
                f"the request asks for {k} sequences (n / best_of), but at most "
                f"max_num_seqs={self.limits.max_num_seqs} run at once"
            )

    # -- making the request ----------------------------------------------------------------
    def process(self, client: ClientRequest) -> Request:
        """Check, tokenize and validate; raises ``ValueError`` with a message fit for the
        client."""
        params, priority = client.params, client.priority
        self.check(client.prompt, params)
        ids = self.tokenize(client.prompt, client.options)
        if not ids:
            raise ValueError("the prompt is empty")
        ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.limits.max_model_len)
        with self.tokenizer_lock:
            prepare_sampling(params, self.tokenizer, self.limits.input_vocab_size)
        self._check_token_ids(ids)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        self._check_parallel_sampling(params)
        rid = client.request_id if client.request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, ids, params, self.eos_token_id, priority)
        if params.structured_outputs is not None:  # compiled here, off the step path
            req.grammar = self.grammars.state_for(params.structured_outputs)
        return req

    def pooling_ids(
        self, prompt: Prompt, options: PromptOptions, truncate: Optional[int] = None
    ) -> list[int]:
        """A pooling request's prompt tokens, checked: it is not generated from, so it may
        fill the whole context (and it runs on a cache of its own, not the shared one)."""
        if prompt == "":
            raise ValueError("the prompt is empty")
        self.check_prompt_size(prompt)
        ids = self.tokenize(prompt, options)
        if not ids:
            raise ValueError("the prompt is empty")
        ids = truncate_prompt(ids, truncate, self.limits.max_model_len)
        vocab, limit = self.limits.input_vocab_size, self.limits.max_model_len
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) > limit:
            raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len is {limit}")
        return ids

    def tokenize(self, prompt: Prompt, options: PromptOptions = PromptOptions()) -> list[int]:
        """A string (optionally wrapped in the chat template as one user turn), a list of
        chat messages (always templated), or token ids."""
        if is_token_ids(prompt):
            return list(prompt)  # token ids: no need to wait while the tokenizer is busy
        with self.tokenizer_lock:
            return self._tokenize(prompt, options)

    def _tokenize(self, prompt: Prompt, options: PromptOptions) -> list[int]:
        if is_chat(prompt):
            return self._apply_chat_template(list(prompt))
        if isinstance(prompt, str):
            if options.apply_chat_template:
                return self._apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer(prompt, add_special_tokens=options.add_special_tokens)[
                "input_ids"
            ]
        if _all_token_ids(prompt):
            return list(prompt)
        raise ValueError("prompt must be a string, a list of chat messages or a list of token ids")

    def _apply_chat_template(self, messages: list[ChatMessage]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; send a plain text prompt")
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("chat messages need string 'role' and 'content' fields")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
