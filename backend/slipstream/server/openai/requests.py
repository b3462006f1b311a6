"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``, and what each field
becomes in the model's ``sampling_parameters`` (Triton vLLM backend's wire format).

Every field is declared: OpenAI's, then vLLM's extra sampling fields. A field is either passed
on (``SAMPLING_FIELDS``: the engine validates the value and its error text comes back as a
400), used here (``model``, ``prompt``, ``messages``, ``stream``, ``echo``, chat-template
settings, logprob counts), or refused when set to anything but its no-op value
(``REFUSED``, with the message a client gets). A field that is not declared is refused by
pydantic (``extra="forbid"``), so nothing is silently ignored. ``user`` is accepted and
recorded nowhere, as in vLLM (an end-user id for abuse monitoring; it changes no output).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional, Union

from pydantic import BaseModel, ConfigDict

from slipstream.server.openai.errors import bad_request

# The fields that constrain the output (structured outputs).
STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_json_object",
)
# Passed to the engine under the same name (vLLM's SamplingParams names).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "n",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    *STRUCTURED_FIELDS,
    "guided_whitespace_pattern",
    "guided_decoding_backend",
    "priority",
    "add_special_tokens",
    "cache_salt",
    # beam search (vLLM's fields: the width is best_of, else n)
    "use_beam_search",
    "length_penalty",
    "early_stopping",
)


def _unset(value: Any) -> bool:
    return value in (None, False, [], {}, "")


# field -> (value is a no-op, message when it is not)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (_unset, "suffix is not supported"),
    "prompt_logprobs": (
        lambda v: v is None,
        "prompt_logprobs is not supported by the OpenAI "
        "frontend (use the Triton generate endpoint)",
    ),
    "functions": (_unset, "functions (function calling) are not supported"),
    "function_call": (lambda v: v in (None, "none"), "function_call is not supported"),
    "audio": (_unset, "audio output is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only the text modality is supported"),
    "prediction": (_unset, "predicted outputs are not supported"),
    "reasoning_effort": (_unset, "reasoning_effort is not supported"),
    "web_search_options": (_unset, "web search is not supported"),
    "store": (_unset, "store is not supported (nothing is stored)"),
    "metadata": (_unset, "metadata is only for stored completions, which are not supported"),
    "service_tier": (
        lambda v: v in (None, "auto", "default"),
        "service_tier must be 'auto' or 'default'",
    ),
    "verbosity": (_unset, "verbosity is not supported"),
    "chat_template": (
        _unset,
        "a request's own chat_template is not supported: the model's is used",
    ),
    "documents": (_unset, "documents are not supported"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = 1
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None  # accepted, recorded nowhere (vLLM likewise)
    response_format: Optional[dict[str, Any]] = None
    # vLLM's extra sampling fields
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_json_object: Optional[bool] = None
    guided_whitespace_pattern: Optional[str] = None
    guided_decoding_backend: Optional[str] = None  # one grammar library here: no effect
    priority: Optional[int] = None
    add_special_tokens: Optional[bool] = None
    cache_salt: Optional[str] = None  # vLLM's: only requests with the same salt share a prefix
    # What routers add to every request they forward (vllm-router and sglang-router send
    # SGLang's fields): accepted with no effect, as vLLM's server ignores them. They change
    # nothing a non-reasoning model returns; without them a router's traffic would be refused.
    no_stop_trim: Optional[bool] = None
    separate_reasoning: Optional[bool] = None
    stream_reasoning: Optional[bool] = None
    return_hidden_states: Optional[bool] = None
    include_reasoning: Optional[bool] = None
    # vLLM's beam search
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    early_stopping: Optional[Union[bool, str]] = None
    # refused unless a no-op (REFUSED)
    prompt_logprobs: Optional[int] = None

    def check_refused(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        for name, (ok, message) in REFUSED.items():
            if name in type(self).model_fields and not ok(getattr(self, name)):
                raise bad_request(message, name)

    def sampling_parameters(self) -> dict[str, Any]:
        """What the engine gets in ``sampling_parameters``; unset fields keep its defaults
        (OpenAI's: temperature 1, top_p 1)."""
        out = {
            name: getattr(self, name)
            for name in SAMPLING_FIELDS
            if name in type(self).model_fields and getattr(self, name) is not None
        }
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.logit_bias:
            out["logit_bias"] = {_token_id(k): v for k, v in self.logit_bias.items()}
        return out


def _token_id(key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    best_of: Optional[int] = None
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None

    def prompts(self) -> list[str]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(p, str) for p in self.prompt):
            return [str(p) for p in self.prompt]
        raise bad_request("prompts as token ids are not supported: send text", "prompt")

    def check(self) -> None:
        self.check_refused()
        if self.echo and self.logprobs is not None:
            raise bad_request(
                "echo with logprobs needs prompt logprobs, which the OpenAI "
                "frontend does not return",
                "echo",
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise bad_request(f"logprobs must be >= 0, got {self.logprobs}", "logprobs")

    def sampling_parameters(self) -> dict[str, Any]:
        out = super().sampling_parameters()
        if self.best_of is not None:
            out["best_of"] = self.best_of
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out

    @property
    def top_logprobs(self) -> Optional[int]:
        return self.logprobs


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    # chat template settings (vLLM's)
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # tool calls (tool_calls.py)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    # OpenAI fields refused unless a no-op (REFUSED)
    functions: Optional[list[Any]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None
    audio: Optional[dict[str, Any]] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    web_search_options: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    verbosity: Optional[str] = None
    chat_template: Optional[str] = None
    documents: Optional[list[Any]] = None

    def check(self) -> None:
        self.check_refused()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request(
                "when using `top_logprobs`, `logprobs` must be set to true", "top_logprobs"
            )
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise bad_request(f"top_logprobs must be >= 0, got {self.top_logprobs}", "top_logprobs")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise bad_request(
                "max_tokens and max_completion_tokens differ; send one", "max_completion_tokens"
            )
        if self.add_generation_prompt and self.continue_final_message:
            raise bad_request(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )

    def sampling_parameters(self) -> dict[str, Any]:
        out = super().sampling_parameters()
        if self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            out["logprobs"] = self.top_logprobs or 0
        # the rendered template holds the special tokens it wants (vLLM's chat default)
        out.setdefault("add_special_tokens", False)
        return out

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them: text content, with an assistant's
        ``tool_calls`` and a tool result's ``tool_call_id`` kept for templates that render
        them (``tool_calls.with_tool_prompt`` writes them out for those that do not)."""
        out = []
        for i, message in enumerate(self.messages):
            role = message.get("role")
            if not isinstance(role, str):
                raise bad_request(f"messages[{i}] has no role", "messages")
            unknown = set(message) - MESSAGE_KEYS.get(role, TEXT_MESSAGE_KEYS)
            if unknown:
                raise bad_request(
                    f"messages[{i}]: {sorted(unknown)} are not supported in a {role!r} message",
                    "messages",
                )
            entry: dict[str, Any] = {
                "role": role,
                "content": _text_content(i, message.get("content")),
            }
            for key in ("name", "tool_call_id"):
                if key in message:
                    entry[key] = message[key]
            if message.get("tool_calls"):
                entry["tool_calls"] = _tool_calls(i, message["tool_calls"])
            out.append(entry)
        if not out:
            raise bad_request("messages is empty", "messages")
        return out


TEXT_MESSAGE_KEYS = frozenset({"role", "content", "name"})
MESSAGE_KEYS = {
    "assistant": TEXT_MESSAGE_KEYS | {"tool_calls"},
    "tool": TEXT_MESSAGE_KEYS | {"tool_call_id"},
}


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's earlier calls, with their arguments as a JSON object (what
    chat templates with a tool format iterate over)."""
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(
                f"messages[{i}].tool_calls: each call needs a function with a name", "messages"
            )
        args = function.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise bad_request(
                    f"messages[{i}].tool_calls: arguments of {function['name']!r} are not JSON",
                    "messages",
                ) from None
        out.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function["name"], "arguments": args},
            }
        )
    return out


def _text_content(i: int, content: Any) -> str:
    """A string, or text parts joined by newlines as vLLM joins them."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(
                    f"messages[{i}]: content part of type {kind!r} is not supported (text only)",
                    "messages",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
