"""One request's response tensors, in Triton's vLLM backend's wire format: which outputs a
request asked for, and what each engine output of it becomes (streamed deltas, or one final
response), with vLLM's per-token logprobs entries. Pure Python (no Triton import).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from slipstream.core.request import FinishReason
from slipstream.server.stub.request_parser import ParsedRequest, RequestOptions


def output_names(options: RequestOptions) -> list:
    """The output tensors a request asked for (text_output always)."""
    names = ["text_output"]
    for flag, name in (
        ("return_finish_reason", "finish_reason"),
        ("return_num_input_tokens", "num_input_tokens"),
        ("return_num_output_tokens", "num_output_tokens"),
        ("return_cumulative_logprob", "cumulative_logprob"),
        ("return_logprobs", "logprobs"),
        ("return_prompt_logprobs", "prompt_logprobs"),
    ):
        if getattr(options, flag):
            names.append(name)
    return names


def build_outputs(
    options: RequestOptions,
    text: str,
    *,
    finish_reason: Optional[str],
    num_input_tokens: int,
    num_output_tokens: int,
    cumulative_logprob: float,
    logprobs_json: str = "null",
    prompt_logprobs_json: str = "null",
) -> dict:
    """name -> numpy array for the requested outputs of one response, in Triton's vLLM
    backend's wire format: ``finish_reason`` is ``"None"`` until the last response,
    ``num_input_tokens`` a UINT32 scalar, ``num_output_tokens`` UINT32 [1] (tokens in this
    response when streaming), ``logprobs`` a JSON string (``"null"`` when not asked for)."""
    return build_sequence_outputs(
        options,
        [text],
        finish_reasons=[finish_reason],
        num_input_tokens=num_input_tokens,
        num_output_tokens=[num_output_tokens],
        cumulative_logprobs=[cumulative_logprob],
        logprobs_json=[logprobs_json],
        prompt_logprobs_json=prompt_logprobs_json,
    )


def build_sequence_outputs(
    options: RequestOptions,
    texts: Sequence[str],
    *,
    finish_reasons: Sequence[Optional[str]],
    num_input_tokens: int,
    num_output_tokens: Sequence[int],
    cumulative_logprobs: Sequence[float],
    logprobs_json: Sequence[str],
    prompt_logprobs_json: str = "null",
) -> dict:
    """``build_outputs`` for ``n`` sequences: as vLLM's backend returns ``n`` > 1, each
    per-sequence output holds one element per sequence, in index order; ``prompt_logprobs``
    (this backend's addition) is one JSON string for the request."""

    def strings(values) -> np.ndarray:
        return np.array([str(v).encode("utf-8") for v in values], dtype=np.object_)

    out = {"text_output": strings(texts)}
    if options.return_finish_reason:
        out["finish_reason"] = strings(finish_reasons)
    if options.return_num_input_tokens:
        out["num_input_tokens"] = np.asarray(num_input_tokens, dtype=np.uint32)
    if options.return_num_output_tokens:
        out["num_output_tokens"] = np.asarray(list(num_output_tokens), dtype=np.uint32)
    if options.return_cumulative_logprob:
        out["cumulative_logprob"] = np.array(list(cumulative_logprobs), dtype=np.float32)
    if options.return_logprobs:
        out["logprobs"] = strings(logprobs_json)
    if options.return_prompt_logprobs:
        out["prompt_logprobs"] = strings([prompt_logprobs_json])
    return out


def logprobs_entries(
    token_ids: Sequence[int], logprobs: Sequence[float], tokenizer, detokenize: bool = True
) -> list:
    """vLLM's per-token logprobs: ``{token id: {"logprob", "rank", "decoded_token"}}`` with
    the sampled token first, then its top-N alternatives (ranks 1..N). Each token is decoded
    on its own, as vLLM does, so the sampled tokens' pieces concatenate to the text."""
    entries = []
    for token, lp in zip(token_ids, logprobs):
        position = {token: (float(lp), getattr(lp, "rank", None))}
        for i, (alt, value) in enumerate(getattr(lp, "top", ())):
            position.setdefault(alt, (value, i + 1))
        entries.append(
            {
                str(t): {
                    "logprob": v,
                    "rank": rank,
                    "decoded_token": decode_token(tokenizer, t) if detokenize else None,
                }
                for t, (v, rank) in position.items()
            }
        )
    return entries


def prompt_logprobs_entries(prompt_logprobs: Sequence, tokenizer, detokenize: bool = True) -> list:
    """vLLM's ``prompt_logprobs``: ``null`` for the first prompt token, then per token
    ``{token id: {"logprob", "rank", "decoded_token"}}``, the prompt token first."""
    return [
        None
        if position is None
        else {
            str(t): {
                "logprob": float(lp),
                "rank": getattr(lp, "rank", None),
                "decoded_token": decode_token(tokenizer, t) if detokenize else None,
            }
            for t, lp in position.items()
        }
        for position in prompt_logprobs
    ]


def decode_token(tokenizer, token_id: int) -> str:
    """One token's text alone; a SentencePiece word-start marker that ``decode`` strips is put
    back as the space it stands for (vLLM does the same)."""
    text = tokenizer.decode([token_id])
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and piece.startswith("\u2581") and not text.startswith(" "):
        text = " " + text
    return text


@dataclass
class _SequenceState:
    """What a response builder keeps of one of the request's sequences."""

    texts: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    cumulative_logprob: float = 0.0


class ResponseBuilder:
    """One request's responses: what to send for each engine output (streaming) or once at
    the end (everything accumulated), with vLLM's prompt-prepending rule. With ``n`` > 1 each
    output tensor holds one element per sequence, in index order; a streamed response carries
    the sequence that moved (its ``index``) and empty deltas for the others."""

    def __init__(self, parsed: ParsedRequest, tokenizer=None, end_ids: Sequence[int] = ()) -> None:
        """``end_ids``: stop tokens whose text is not emitted (the ``end_id`` input)."""
        self.options, self.params, self.prompt = parsed.options, parsed.params, parsed.prompt
        self.tokenizer = tokenizer
        self.end_ids = tuple(end_ids)
        self.sequences = [_SequenceState() for _ in range(parsed.params.n)]
        self.prompt_logprobs: Optional[list] = None

    def streamed(self, out) -> Optional[dict]:
        """The response for one engine output of a streaming request; None for a beam search
        round (its beams' texts come when they finish, each under its index)."""
        if out.beams is not None:
            return None
        return self.delta(out)

    def delta(self, out) -> dict:
        """What one engine output adds, as a response (the sequence that moved, under its
        index; empty deltas for the others)."""
        out = self._strip_end_id(out)
        self._note(out)
        deltas = [_SequenceState() for _ in self.sequences]
        deltas[out.index] = _SequenceState(
            [out.text], list(out.token_ids), list(out.logprobs or [])
        )
        return self._outputs(out, ["".join(d.texts) for d in deltas], deltas, out.prompt_logprobs)

    def absorb(self, out) -> None:
        """Non-streaming: keep an output for the final response."""
        out = self._strip_end_id(out)
        seq = self._note(out)
        seq.texts.append(out.text)
        seq.token_ids.extend(out.token_ids)
        seq.logprobs.extend(out.logprobs or [])

    def final(self, out) -> dict:
        """Non-streaming: the one response, after the finished output."""
        self.absorb(out)
        prefix = "" if self.options.exclude_input_in_output else self.prompt
        texts = [prefix + "".join(s.texts) for s in self.sequences]
        return self._outputs(out, texts, self.sequences, self.prompt_logprobs)

    def finals(self, out) -> list:
        """The last responses of a request that is not streamed: one."""
        return [self.final(out)]

    def _strip_end_id(self, out):
        """The finished output without the text of the ``end_id`` token that stopped it
        (TensorRT-LLM stops on it without detokenizing it)."""
        if not (
            self.end_ids
            and out.finished
            and out.token_ids
            and out.finish_reason is FinishReason.STOP
            and out.token_ids[-1] in self.end_ids
            and self.tokenizer is not None
        ):
            return out
        piece = self.tokenizer.decode([out.token_ids[-1]])
        if piece and out.text.endswith(piece):
            return dataclasses.replace(out, text=out.text[: -len(piece)])
        return out

    def _note(self, out) -> _SequenceState:
        seq = self.sequences[out.index]
        if out.finish_reason is not None:
            seq.finish_reason = out.finish_reason
        seq.cumulative_logprob = out.cumulative_logprob
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        return seq

    def _outputs(self, out, texts: list, parts: list, prompt_lps: Optional[list]) -> dict:
        logprobs_json = ["null"] * len(parts)
        if self.options.return_logprobs and self.params.logprobs is not None:
            logprobs_json = [
                json.dumps(
                    logprobs_entries(
                        p.token_ids, p.logprobs, self.tokenizer, self.params.detokenize
                    )
                )
                for p in parts
            ]
        prompt_json = "null"
        if self.options.return_prompt_logprobs and prompt_lps is not None:
            prompt_json = json.dumps(
                prompt_logprobs_entries(prompt_lps, self.tokenizer, self.params.detokenize)
            )
        if len(self.sequences) == 1:  # the finished output carries the sequence's own state
            finish_reasons = [out.finish_reason]
        else:
            finish_reasons = [s.finish_reason for s in self.sequences]
        return build_sequence_outputs(
            self.options,
            texts,
            finish_reasons=finish_reasons,
            num_input_tokens=out.num_prompt_tokens,
            num_output_tokens=[len(p.token_ids) for p in parts],
            cumulative_logprobs=[s.cumulative_logprob for s in self.sequences],
            logprobs_json=logprobs_json,
            prompt_logprobs_json=prompt_json,
        )
