"""Fixtures of the benchmark-code tests."""

import pytest

from slipstream.worker.model.loader import load_tokenizer
from support import tiny_model_dir


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny llama's tokenizer, loaded as the benchmarks load it."""
    return load_tokenizer(tiny_model_dir("llama"))
