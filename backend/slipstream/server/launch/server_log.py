"""Triton's log of one launched server, as the launcher reads it: where a run starts in the
file, its tail for error messages, whether the server came up, which models failed to load and
why, and whether a Slipstream model has begun to finalize."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import BinaryIO, Optional, Union

STDOUT_LOG = "-"  # log_path that sends Triton's log to this process's stdout (containers)
_LOAD_ERROR = re.compile(
    r"failed to load '([^']+)' version \d+: (?:Internal: )?([^\n]*?)(?:\\n|\"$)", re.M
)


def log_file(log_path: Union[str, Path, None]) -> Optional[Path]:
    """Where Triton's log goes: None for stdout (STDOUT_LOG), a temp file when none is given."""
    if log_path == STDOUT_LOG:
        return None
    if log_path:
        return Path(log_path)
    return Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])


class ServerLog:
    """The log file (``path``; None when the log goes to stdout, where nothing can be read)."""

    def __init__(self, path: Optional[Path]) -> None:
        self.path = path
        self.run_start = 0  # where this run's lines begin (a restart appends to the file)
        self.sink: Optional[BinaryIO] = None  # what tritonserver writes to; None: stdout

    def open(self) -> Optional[BinaryIO]:
        """Open for a new run of the server: its stdout and stderr."""
        self.sink = open(self.path, "ab", buffering=0) if self.path is not None else None
        self.run_start = self.sink.tell() if self.sink is not None else 0
        return self.sink

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()

    def size(self) -> int:
        return self.path.stat().st_size if self.path is not None and self.path.exists() else 0

    def since(self, offset: int) -> Optional[bytes]:
        """What was written from ``offset`` on; None when it cannot be read."""
        if self.path is None:
            return None
        try:
            with open(self.path, "rb") as f:
                f.seek(offset)
                return f.read()
        except OSError:
            return None

    def tail(self, chars: int = 6000) -> str:
        if self.path is None:
            return "(the log went to stdout)"
        text = self.since(0)
        return "" if text is None else text.decode(errors="replace")[-chars:]

    def came_up(self) -> bool:
        """Whether this run's tritonserver got as far as listening: one that dies after that
        crashed while serving, one that dies before failed to start. Unknown (False) with the
        log on stdout."""
        text = self.since(self.run_start) or b""
        return b"Started GRPCInferenceService" in text and b"Started HTTPService" in text

    def load_errors(self) -> list[tuple[str, str]]:
        """(model, reason) for each model Triton failed to load (the reason's first line: a
        model's own error, e.g. a refused setting)."""
        text = (self.since(0) or b"").decode(errors="replace")
        return list(dict.fromkeys(_LOAD_ERROR.findall(text)))

    def finalizing_since(self, offset: int) -> bool:
        """Whether a slipstream model has begun its finalize since ``offset``. With the log on
        stdout there is no telling: assume it has, so a stop waits for its deadline."""
        if self.path is None:
            return True
        return b"slipstream: finalize" in (self.since(offset) or b"")
