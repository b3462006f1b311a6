"""``ENABLE_VLLM_HEALTH_CHECK``: is the engine still able to serve?

As in Triton's vLLM backend, the check runs before each batch of requests; the first failure
unloads the model (it goes not-ready; Triton then answers "unknown model") and the requests
that found it unhealthy get vLLM's UNAVAILABLE text, which its clients match.
"""
from __future__ import annotations

from typing import Optional

UNHEALTHY_MESSAGE = "Model is unavailable due to unhealthy vLLM engine"


def engine_problem(loop) -> Optional[str]:
    """Why ``loop`` cannot serve, or None. An ``EngineLoop.check_health()`` (raising when the
    engine is unhealthy) is asked where the loop has one; otherwise the loop thread must be
    alive."""
    check = getattr(loop, "check_health", None)
    if callable(check):
        try:
            check()
        except Exception as e:  # the engine's own verdict
            return str(e) or type(e).__name__
        return None
    thread = getattr(loop, "_thread", None)
    if thread is None or not thread.is_alive():
        return "the engine loop is not running"
    return None
