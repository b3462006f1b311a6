"""The start-up phases of an engine (model conversion, kernel build, weight load, packing, KV
allocation, CUDA-graph capture), each logged as it begins, progresses and ends, as one
structured line on the ``slipstream`` logger:

    slipstream phase {"phase": "kernel build", "event": "end", "seconds": 71.3}

Inside Triton the stub hands the logger's lines to Triton's log (``pb_utils.Logger``), where
``slipstream serve`` reads them and prints each phase as it happens, with its time and a
progress bar where a phase has steps. The line is the contract between the two: ``parse`` is
its one reader.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

MARK = "slipstream phase "
log = logging.getLogger("slipstream")


class Phase(str, enum.Enum):
    CONVERSION = "model conversion"
    KERNEL_BUILD = "kernel build"
    WEIGHT_LOAD = "weight load"
    PACKING = "packing"
    KV_ALLOCATION = "KV allocation"
    GRAPH_CAPTURE = "CUDA-graph capture"


class Event(str, enum.Enum):
    START = "start"
    PROGRESS = "progress"  # ``done`` of ``total`` steps
    END = "end"  # ``seconds``


@dataclass(frozen=True)
class PhaseEvent:
    phase: str
    event: Event
    seconds: float = 0.0
    done: int = 0
    total: int = 0
    detail: dict[str, Any] = field(default_factory=dict)  # what the phase made (blocks, format)


def emit(phase: Phase, event: Event, **fields: Any) -> None:
    log.info("%s%s", MARK, json.dumps({"phase": phase.value, "event": event.value, **fields}))


@dataclass
class PhaseProgress:
    """Handed to the body of ``phase``: steps done, and what the phase made."""

    phase: Phase
    total: int = 0
    detail: dict[str, Any] = field(default_factory=dict)

    def step(self, done: int) -> None:
        emit(self.phase, Event.PROGRESS, done=done, total=self.total)


@contextmanager
def phase(name: Phase, total: int = 0, **detail: Any) -> Iterator[PhaseProgress]:
    """Log the phase's start, then its end with its time and ``detail`` (the body may add to
    ``progress.detail``). A phase that raises logs no end: the error says what happened."""
    emit(name, Event.START, total=total, **detail)
    start = time.monotonic()
    progress = PhaseProgress(name, total, dict(detail))
    yield progress
    emit(name, Event.END, seconds=round(time.monotonic() - start, 3), **progress.detail)


def parse(line: str) -> Optional[PhaseEvent]:
    """The phase event a log line carries (Triton's prefix and quoting around it allowed)."""
    at = line.find(MARK)
    if at < 0:
        return None
    text = line[at + len(MARK) :].strip()
    if text.startswith('{\\"'):  # Triton quotes its messages: {\"phase\": ...}"
        text = _unquote(text)
    try:
        fields, _ = json.JSONDecoder().raw_decode(text)
        event = Event(fields.pop("event"))
        name = str(fields.pop("phase"))
    except (ValueError, KeyError, TypeError):
        return None
    seconds = float(fields.pop("seconds", 0.0))
    done, total = int(fields.pop("done", 0)), int(fields.pop("total", 0))
    return PhaseEvent(name, event, seconds, done, total, fields)


def _unquote(text: str) -> str:
    """The rest of a message Triton wrote as a JSON string (its closing quote ends it)."""
    end = text.rfind('"')
    try:
        return str(json.loads('"' + text[:end] + '"'))
    except ValueError:
        return text
