"""Slipstream: an in-flight batching LLM engine with a paged KV cache."""

from slipstream.core.config import EngineConfig
from slipstream.core.request import RequestOutput, RequestStatus
from slipstream.core.sampling_params import SamplingParams

__all__ = ["EngineConfig", "SamplingParams", "RequestOutput", "RequestStatus"]
__version__ = "0.1.0"
