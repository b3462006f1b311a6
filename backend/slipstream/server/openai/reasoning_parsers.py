"""``--reasoning-parser``: a model's reasoning, written between think tags, goes to the
answer's ``reasoning_content`` and the rest to ``content`` (vLLM's names and split rules).

* ``deepseek_r1``: the chat template opens ``<think>`` itself, so the output may hold only
  the end tag: everything before ``</think>`` is reasoning; an output without the end tag is
  all reasoning (the model was still thinking when it stopped).
* ``qwen3`` (also ``glm45``): reasoning only when the output holds both tags (a model told
  not to think writes none, or an empty pair); without them everything is content.

``ReasoningSplitter`` does the split as text streams in: a tag cut between two deltas is held
back until it is complete, so no part of a tag ever reaches a client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    needs_start_tag: bool  # reasoning only between an explicit <think> and </think>


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", needs_start_tag=False),
    "qwen3": ReasoningFormat("qwen3", needs_start_tag=True),
    "glm45": ReasoningFormat("glm45", needs_start_tag=True),
}


def reasoning_format(name: Optional[str]) -> Optional[ReasoningFormat]:
    if name is None:
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}"
        ) from None


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


def split_whole(fmt: ReasoningFormat, text: str) -> tuple[Optional[str], str]:
    """(reasoning or None, content) of a whole output."""
    if fmt.needs_start_tag:
        start = text.find(START)
        end = text.find(END, start + len(START)) if start >= 0 else -1
        if start < 0 or end < 0:
            return None, text
        return text[start + len(START) : end], text[:start] + text[end + len(END) :]
    body = text[len(START) :] if text.startswith(START) else text
    end = body.find(END)
    if end < 0:
        return body, ""
    return body[:end], body[end + len(END) :]


def _held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """The split of a streamed output, delta by delta."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.buffer = ""  # text not yet assigned (it may hold part of a tag)
        # before: no tag seen yet; thinking: inside the tags; after: content for good
        self.phase = "before"

    def feed(self, text: str) -> Split:
        self.buffer += text
        out = Split()
        while True:
            if self.phase == "after":
                out.content += self.buffer
                self.buffer = ""
                return out
            if self.phase == "before":
                if not self._leave_before(out):
                    return out
                continue
            end = self.buffer.find(END)
            if end < 0:
                keep = _held(self.buffer, END)
                out.reasoning += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return out
            out.reasoning += self.buffer[:end]
            self.buffer = self.buffer[end + len(END) :]
            self.phase = "after"

    def _leave_before(self, out: Split) -> bool:
        """Look for the start of reasoning in the buffer; False while it must wait."""
        start = self.buffer.find(START)
        if start >= 0:
            if self.fmt.needs_start_tag:
                out.content += self.buffer[:start]
            self.buffer = self.buffer[start + len(START) :]
            self.phase = "thinking"
            return True
        if not self.fmt.needs_start_tag:
            # deepseek_r1: the template opened the tag; wait only while the output could
            # still begin with <think> itself
            if START.startswith(self.buffer):
                return False
            self.phase = "thinking"
            return True
        keep = _held(self.buffer, START)
        out.content += self.buffer[: len(self.buffer) - keep]
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return False

    def finish(self) -> Split:
        """What is held when the output ends."""
        out = Split()
        if self.phase == "thinking" or (self.phase == "before" and not self.fmt.needs_start_tag):
            out.reasoning = self.buffer
        else:
            out.content = self.buffer
        self.buffer = ""
        return out
