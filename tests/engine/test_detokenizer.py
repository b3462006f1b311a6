"""Incremental detokenization: UTF-8 safety and stop strings across token boundaries."""

from __future__ import annotations

import functools

from slipstream.engine.detokenizer import IncrementalDetokenizer
from slipstream.worker.model.loader import load_tokenizer
from support import tiny_model_dir


@functools.lru_cache(maxsize=None)
def tokenizer():
    return load_tokenizer(tiny_model_dir("llama"))


def stream(text_ids, prompt, stop=None):
    tok = tokenizer()
    detok = IncrementalDetokenizer(tok, prompt, stop)
    ids = list(prompt)
    deltas = []
    for t in text_ids:
        ids.append(t)
        detok.update(ids)
        deltas.append(detok.take(final=False))
        if detok.stopped_on:
            break
    deltas.append(detok.take(final=True))
    return deltas, detok


def test_multibyte_characters_are_never_split():
    tok = tokenizer()
    text = " héllo wörld 日本語 🚀 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # the tokenizer really splits characters
    deltas, _ = stream(ids, tok("Say:")["input_ids"])
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_spanning_tokens_is_not_emitted():
    tok = tokenizer()
    text = "alpha beta STOPWORD gamma"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    deltas, detok = stream(ids, [1], stop=["STOPWORD"])
    assert "".join(deltas) == "alpha beta "
    assert detok.stopped_on == "STOPWORD"
    # The stop string spans several tokens, and no partial prefix of it was ever sent.
    assert len(tok(" STOPWORD", add_special_tokens=False)["input_ids"]) > 1
    assert all("STO" not in d for d in deltas)


def test_held_back_text_is_released_when_not_a_stop():
    tok = tokenizer()
    ids = tok("one two STO three", add_special_tokens=False)["input_ids"]
    deltas, detok = stream(ids, [1], stop=["STOP"])
    assert "".join(deltas) == "one two STO three" and detok.stopped_on is None
