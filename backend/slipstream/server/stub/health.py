"""``ENABLE_VLLM_HEALTH_CHECK``: is the engine still able to serve?

As in Triton's vLLM backend, the check runs before each batch of requests; the first failure
unloads the model (it goes not-ready; Triton then answers "unknown model") and the requests
that found it unhealthy get vLLM's UNAVAILABLE text, which its clients match.
"""

from __future__ import annotations

from typing import Optional

UNHEALTHY_MESSAGE = "Model is unavailable due to unhealthy vLLM engine"


def engine_problem(engine) -> Optional[str]:
    """Why ``engine`` (an ``EngineSupervisor`` or ``EngineLoop``) cannot serve, or None: any
    state but healthy (dead, restarting after a crash, stopped) fails the check."""
    health = engine.health()
    if health.ok:
        return None
    return health.error or f"the engine is {health.state.value}"
