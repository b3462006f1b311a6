"""The device sampler's random numbers: one uniform per sampled row, from counter-based streams.

A seeded request owns the stream keyed by its seed; its n-th draw is a pure function of
(seed, n) -- SplitMix64's n-th output -- so its tokens are the same whatever else shares
its steps, on any device and in any process, and a draw costs nothing on the device: the
numbers are made on the host (a few numpy operations for the whole batch) and travel with
the step's other inputs. Requests without a seed share the engine's stream (keyed by the
engine's ``seed``).

A batch's draws are *committed* only once its tokens came back: a step that fails and is
retried request by request draws the same numbers again (as the CPU sampler rewinds its
generators).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_ENGINE_SALT = 0xD1B54A32D192ED03  # the engine's stream differs from a request seeded alike
_MASK64 = (1 << 64) - 1


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (a bijection of 64-bit words); numpy's uint64 wraps."""
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


def uniforms(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Draw ``counters[i]`` (0, 1, ...) of the stream ``keys[i]``: float64 in [0, 1)."""
    keys = np.asarray(keys, dtype=np.uint64)
    counters = np.asarray(counters, dtype=np.uint64)
    state = _mix64(keys) + (counters + np.uint64(1)) * _GOLDEN
    return (_mix64(state) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def key_of(seed: int) -> int:
    """A seed (vLLM's range, negative ones wrap) as a 64-bit stream key."""
    return seed & _MASK64


@dataclass
class Draws:
    """A batch's uniforms and the stream positions they leave behind."""

    values: np.ndarray  # float64, one per sampled row
    advanced: dict[Optional[str], int] = field(default_factory=dict)  # stream -> next counter


class UniformStreams:
    def __init__(self, seed: int = 0) -> None:
        self.engine_key = key_of(seed) ^ _ENGINE_SALT
        self.engine_counter = 0
        self.counters: dict[str, int] = {}  # seeded request id -> draws made

    def forget(self, request_id: str) -> None:
        self.counters.pop(request_id, None)

    def draw(self, rows: list) -> Draws:
        """One uniform per request in ``rows`` (a request listed k times draws k numbers, in
        row order); nothing is committed."""
        keys = np.empty(len(rows), dtype=np.uint64)
        counters = np.empty(len(rows), dtype=np.uint64)
        advanced: dict[Optional[str], int] = {None: self.engine_counter}
        for i, req in enumerate(rows):
            seed = req.params.seed
            stream = None if seed is None else req.request_id
            if stream not in advanced:
                advanced[stream] = self.counters.get(stream, 0)  # type: ignore[arg-type]
            keys[i] = self.engine_key if seed is None else key_of(seed)
            counters[i] = advanced[stream]
            advanced[stream] += 1
        return Draws(uniforms(keys, counters), advanced)

    def commit(self, draws: Draws) -> None:
        for stream, counter in draws.advanced.items():
            if stream is None:
                self.engine_counter = counter
            else:
                self.counters[stream] = counter
