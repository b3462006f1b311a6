"""The engine: requests in, one step at a time, outputs out (see docs/architecture.md)."""
from slipstream.core.request import merge_output
from slipstream.engine.llm_engine import OVERLOADED, LLMEngine, OverloadedError, Prompt

__all__ = ["LLMEngine", "OVERLOADED", "OverloadedError", "Prompt", "merge_output"]
