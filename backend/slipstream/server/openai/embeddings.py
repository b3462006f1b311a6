"""``/v1/embeddings``: the request body (OpenAI's fields and vLLM's extras) and the response,
each input one pooling request through Triton (``TritonGenerator.embed``: the model's
``embedding_request`` input, as vllm_backend takes it), all of a request's inputs at once.

The vector is the model's last-layer hidden states pooled as the server's ``--pooler-config``
says (vLLM's ``pooling_type``: ``LAST`` by default for decoder models, ``MEAN``, ``CLS``;
``normalize``: true by default; a request's own ``normalize`` wins). ``dimensions`` is
refused with vLLM's message (no model here is trained for Matryoshka truncation).
"""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

from slipstream.server.openai.errors import bad_request
from slipstream.server.openai.served_models import Target
from slipstream.server.openai.triton_client import EmbedRequest, TritonGenerator

MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None  # accepted, recorded nowhere (vLLM likewise)
    # vLLM's extras
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: Optional[bool] = None
    normalize: Optional[bool] = None

    def inputs(self) -> list[Union[str, list[int]]]:
        value = self.input
        if isinstance(value, str):
            items: list[Union[str, list[int]]] = [value]
        elif value and all(isinstance(v, int) for v in value):
            items = [list(value)]  # type: ignore[arg-type] # one prompt as token ids
        else:
            items = list(value)  # type: ignore[arg-type] # strings or token-id lists
        if not items:
            raise bad_request("input is empty", "input")
        if len(items) > MAX_INPUTS:
            raise bad_request(
                f"input has {len(items)} items; at most {MAX_INPUTS} per request", "input"
            )
        for i, item in enumerate(items):
            if item == "" or item == []:
                raise bad_request(f"input[{i}] is empty", "input")
        return items

    def check(self, target: Target) -> None:
        if self.dimensions is not None:
            raise bad_request(
                f'Model "{target.id}" does not support matryoshka representation, changing '
                "output dimensions will lead to poor results.",
                "dimensions",
            )
        if target.lora_name is not None:
            raise bad_request(
                "embeddings of a LoRA adapter are not supported: ask its base model", "model"
            )


def _encoded(vector: list[float], encoding: str) -> Union[list[float], str]:
    """OpenAI's ``base64``: the little-endian float32 bytes of the vector."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def create_embeddings(
    generator: TritonGenerator,
    target: Target,
    body: EmbeddingRequest,
    pooling: dict[str, Any],
) -> dict[str, Any]:
    """Every input's vector, all of them through Triton at once; the first error ends them."""
    body.check(target)
    pooling = dict(pooling)
    if body.normalize is not None:
        pooling["normalize"] = body.normalize
    requests = [
        EmbedRequest(
            target.model.name,
            item,
            pooling,
            body.truncate_prompt_tokens,
            body.add_special_tokens,
        )
        for item in body.inputs()
    ]
    results = await asyncio.gather(*(generator.embed(r) for r in requests))
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(vector, body.encoding_format)}
        for i, (vector, _) in enumerate(results)
    ]
    tokens = sum(count for _, count in results)
    # OpenAI's CreateEmbeddingResponse (its type holds floats only; base64 is a string)
    return {
        "object": "list",
        "data": data,
        "model": target.id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
