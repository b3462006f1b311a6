"""Slipstream: an in-flight batching LLM engine with a paged KV cache."""
from .config import EngineConfig
from .request import RequestOutput, RequestStatus
from .sampling_params import SamplingParams

__all__ = ["EngineConfig", "SamplingParams", "RequestOutput", "RequestStatus"]
__version__ = "0.1.0"
