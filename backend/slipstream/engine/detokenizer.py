"""Incremental detokenization with stop strings.

Text is emitted only once it is stable: never half a multi-byte UTF-8 character (the
tokenizer shows those as U+FFFD until the rest arrives), and never a piece that could be
the start of a stop string, which is held back until it is known not to be one.

Each update costs what the new tokens cost, whatever the request: stop strings are looked
for only in the text that could newly hold one, and a character that stays incomplete is
given up on after a few tokens instead of decoding an ever longer tail. A failure here
belongs to this request alone: it is kept in ``error`` (the step ends the request with it)
instead of being raised into the step that other requests share.
"""

from __future__ import annotations

from typing import Optional

_CONTEXT_TOKENS = 6  # prompt tokens decoded with the first output token, for correct spacing
# A UTF-8 character spans at most 4 byte tokens: a tail still incomplete after this many
# tokens is not one character in progress, and is emitted as it decodes.
_MAX_PENDING_TOKENS = 8


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list,
        stop: Optional[list] = None,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        detokenize: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.skip_special_tokens = skip_special_tokens
        # Only slow (Python) tokenizers honour it; fast ones ignore it, as in vLLM.
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.detokenize = detokenize
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.prefix_offset = max(len(prompt_token_ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(prompt_token_ids)
        self.text = ""  # all stable output text so far
        self.emitted = 0  # characters of ``text`` already returned
        self.stopped_on: Optional[str] = None
        self.error: Optional[str] = None  # why this request's text could not be produced

    @classmethod
    def for_params(cls, tokenizer, prompt_token_ids: list, params) -> "IncrementalDetokenizer":
        """The detokenizer a request's ``SamplingParams`` ask for."""
        return cls(
            tokenizer,
            prompt_token_ids,
            params.stop,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            detokenize=params.detokenize,
        )

    def _decode(self, ids: list) -> str:
        kwargs = (
            {} if self.spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        )
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
            **kwargs,
        )

    def update(self, all_token_ids: list) -> None:
        """Absorb newly appended tokens (``all_token_ids`` is prompt + output so far)."""
        if self.stopped_on is not None or self.error is not None or not self.detokenize:
            return
        try:
            self._update(all_token_ids)
        except Exception as exc:  # noqa: BLE001 - this request's failure, not the step's
            self.error = f"detokenization failed: {type(exc).__name__}: {exc}"

    def _update(self, all_token_ids: list) -> None:
        before = self._decode(all_token_ids[self.prefix_offset : self.read_offset])
        after = self._decode(all_token_ids[self.prefix_offset :])
        pending = len(all_token_ids) - self.read_offset
        if len(after) <= len(before) or after.endswith("\ufffd"):
            if pending < _MAX_PENDING_TOKENS:
                return  # incomplete character: wait for the next token
            if len(after) <= len(before):  # tokens that decode to nothing (special ones)
                self.prefix_offset, self.read_offset = self.read_offset, len(all_token_ids)
                return
        new = after[len(before) :]
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
            at, stop = best
            self.text = self.text[: at + len(stop) if self.include_stop_str_in_output else at]
            self.stopped_on = stop

    def take(self, final: bool) -> str:
        """The text delta safe to send now (everything that is left when ``final``)."""
        end = (
            len(self.text)
            if final or self.stopped_on
            else max(len(self.text) - self.hold, self.emitted)
        )
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
