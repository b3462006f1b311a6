"""Incremental detokenization with stop strings.

Text is emitted only once it is stable: never half a multi-byte UTF-8 character (the
tokenizer shows those as U+FFFD until the rest arrives), and never a piece that could be
the start of a stop string, which is held back until it is known not to be one.
"""
from __future__ import annotations

from typing import Optional

_CONTEXT_TOKENS = 6  # prompt tokens decoded with the first output token, for correct spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list, stop: Optional[list] = None) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.prefix_offset = max(len(prompt_token_ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(prompt_token_ids)
        self.text = ""  # all stable output text so far
        self.emitted = 0  # characters of ``text`` already returned
        self.stopped_on: Optional[str] = None

    def _decode(self, ids: list) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def update(self, all_token_ids: list) -> None:
        """Absorb newly appended tokens (``all_token_ids`` is prompt + output so far)."""
        if self.stopped_on is not None:
            return
        before = self._decode(all_token_ids[self.prefix_offset:self.read_offset])
        after = self._decode(all_token_ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return  # incomplete character: wait for the next token
        new = after[len(before):]
        search_from = max(len(self.text) - self.hold, 0)
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(all_token_ids)
        self._check_stop(search_from)

    def _check_stop(self, search_from: int) -> None:
        best = None
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            self.text = self.text[:best[0]]
            self.stopped_on = best[1]

    def take(self, final: bool) -> str:
        """The text delta safe to send now (everything that is left when ``final``)."""
        end = len(self.text) if final or self.stopped_on else max(len(self.text) - self.hold, self.emitted)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
