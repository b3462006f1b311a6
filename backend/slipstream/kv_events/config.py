"""``kv_events_config``: vLLM's ``KVEventsConfig`` fields, read from ``config.pbtxt``
parameters or ``1/model.json`` (a JSON object either way)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Union

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None  # None: "zmq" when enabled, else "null" (vLLM's rule)
    # tcp://*:PORT, ipc:// and inproc:// bind; tcp://HOST:PORT connects to a subscriber
    # that binds (vLLM's rule).
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None  # a ROUTER socket that re-sends buffered batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (a slow subscriber loses batches)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; more are dropped
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config: publisher must be one of {PUBLISHERS}, got {self.publisher!r}"
            )
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config: enable_kv_cache_events must be a boolean")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config: {name} must be an integer >= 1, got {value!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(
                ("tcp://", "ipc://", "inproc://")
            ):
                raise ValueError(
                    f"kv_events_config: {name} must be a tcp://, ipc:// or "
                    f"inproc:// address, got {value!r}"
                )
        if not isinstance(self.topic, str):
            raise ValueError("kv_events_config: topic must be a string")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: Union[str, Mapping[str, Any], None]) -> Optional["KVEventsConfig"]:
        """A JSON object (text or already parsed); None or "" for no config."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"kv_events_config: not valid JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise ValueError(
                "kv_events_config must be a JSON object of vLLM's KVEventsConfig fields"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"kv_events_config: unknown field(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**dict(value))
