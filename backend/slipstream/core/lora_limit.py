"""``max_loras``: how many distinct LoRA adapters the requests running together may use.

As in vLLM's scheduler, the limit holds over the running set (so every step's batch is within
it): a waiting request whose adapter is not among the running ones' is deferred, not refused,
while ``max_loras`` others are in use; requests on the base model or on an adapter already
running are always admissible.
"""

from __future__ import annotations

from typing import Iterable, Optional

from slipstream.core.request import Request


def adapters_of(requests: Iterable[Request]) -> set[str]:
    return {r.params.lora_name for r in requests if r.params.lora_name is not None}


def fits(req: Request, active: set[str], max_loras: Optional[int]) -> bool:
    """Whether ``req`` may run beside requests using ``active`` adapters
    (``max_loras`` None: LoRA is off and no request names an adapter)."""
    name = req.params.lora_name
    return max_loras is None or name is None or name in active or len(active) < max_loras


def admissible(
    waiting: list[Request], running: list[Request], max_loras: Optional[int]
) -> list[Request]:
    """The waiting requests that may be admitted next without exceeding ``max_loras``."""
    if max_loras is None:
        return waiting
    active = adapters_of(running)
    return [r for r in waiting if fits(r, active, max_loras)]
