"""The users: each conversation runs its turns in order over the OpenAI chat API (streamed),
recording when each turn was sent, its first token and its end."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Optional

from router_bench.conversations import Conversation


@dataclass
class TurnRecord:
    conversation: str
    system_id: int
    turn: int
    sent_s: float  # from the start of the run
    ttft_s: Optional[float]
    latency_s: Optional[float]
    output_tokens: int  # the usage the server reports (content chunks where it reports none)
    error: Optional[str] = None

    def as_dict(self) -> dict:
        return asdict(self)


async def _turn(client, model: str, messages: list, max_tokens: int) -> tuple:
    """(first content chunk after s, end after s, chunks, text)."""
    start = time.perf_counter()
    first, chunks, text, usage = None, 0, [], None
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            first = first if first is not None else time.perf_counter() - start
            chunks += 1
            text.append(delta)
        if getattr(chunk, "usage", None):
            usage = chunk.usage.completion_tokens
    tokens = usage if usage is not None else chunks
    return first, time.perf_counter() - start, tokens, "".join(text)


async def _conversation(
    client, model: str, conv: Conversation, t0: float, max_tokens: int, records: list
) -> None:
    await asyncio.sleep(max(0.0, t0 + conv.start_s - time.perf_counter()))
    messages = [{"role": "system", "content": conv.system}]
    for k, user in enumerate(conv.user_messages):
        messages.append({"role": "user", "content": user})
        sent = time.perf_counter() - t0
        try:
            ttft, latency, chunks, answer = await _turn(client, model, messages, max_tokens)
            records.append(TurnRecord(conv.id, conv.system_id, k, sent, ttft, latency, chunks))
        except Exception as e:  # noqa: BLE001 - recorded; the conversation stops here
            records.append(
                TurnRecord(
                    conv.id,
                    conv.system_id,
                    k,
                    sent,
                    None,
                    None,
                    0,
                    f"{type(e).__name__}: {e}"[:300],
                )
            )
            return
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(conv.think_s)


async def _run(
    base_url: str, model: str, conversations: list, max_tokens: int, timeout_s: float
) -> list:
    from openai import AsyncOpenAI

    records: list[TurnRecord] = []
    async with AsyncOpenAI(
        base_url=base_url, api_key="none", timeout=timeout_s, max_retries=0
    ) as client:
        t0 = time.perf_counter()
        await asyncio.wait_for(
            asyncio.gather(
                *[_conversation(client, model, c, t0, max_tokens, records) for c in conversations]
            ),
            timeout=timeout_s,
        )
    return records


def run_workload(
    base_url: str, model: str, conversations: list, max_tokens: int, timeout_s: float = 900.0
) -> tuple:
    """(records, wall seconds) of every conversation against ``base_url`` (…/v1)."""
    start = time.perf_counter()
    records = asyncio.run(_run(base_url, model, conversations, max_tokens, timeout_s))
    return records, time.perf_counter() - start
