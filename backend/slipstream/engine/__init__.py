"""The engine: requests in, one step at a time, outputs out (see docs/architecture.md).

``EngineLoop`` (``slipstream.engine.loop``) runs it on its own thread for servers;
``EngineSupervisor`` (``slipstream.engine.supervisor``) restarts a dead one."""

from slipstream.core.request import merge_output
from slipstream.engine.admission import OVERLOADED, RETRY_AFTER_S, OverloadedError
from slipstream.engine.input_processor import Prompt
from slipstream.engine.llm_engine import LLMEngine, StepResult

__all__ = [
    "LLMEngine",
    "OVERLOADED",
    "OverloadedError",
    "Prompt",
    "RETRY_AFTER_S",
    "StepResult",
    "merge_output",
]
