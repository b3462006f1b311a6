"""vLLM's ``/tokenize`` and ``/detokenize``: a prompt (or a chat conversation, rendered as
``/v1/chat/completions`` renders it) to the token ids the engine will see, and token ids back
to text, with the model's own tokenizer. Open without an API key, as in vLLM."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict

from slipstream.server.openai.errors import bad_request
from slipstream.server.openai.served_models import Target

# What a tokenize request's conversation shares with a chat request: rendered alike.
CHAT_FIELDS: set[str] = {
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "tools",
}


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None  # default: the served model (when there is one)
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_special_tokens: Optional[bool] = None  # prompt: true; messages: false (vLLM's)
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    return_token_strs: Optional[bool] = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send either `prompt` or `messages`", "prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    tokens: list[int]


def tokenize(target: Target, body: TokenizeRequest, text: str) -> dict[str, Any]:
    """``text``: the prompt, or the conversation already rendered."""
    tokenizer = target.model.tokenizer
    special = body.add_special_tokens
    if special is None:
        special = body.messages is None
    ids = tokenizer(text, add_special_tokens=special)["input_ids"]
    out: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": target.model.max_model_len,
        "tokens": ids,
    }
    if body.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(target: Target, body: DetokenizeRequest) -> dict[str, Any]:
    tokenizer = target.model.tokenizer
    vocab = len(tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token ids must be in [0, {vocab}), got {bad[0]}", "tokens")
    return {"prompt": tokenizer.decode(body.tokens)}
