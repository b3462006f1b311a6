"""What ``slipstream serve`` prints while a model starts: each start-up phase the engine logs
(``slipstream.startup_log``: model conversion, kernel build, weight load, packing, KV
allocation, CUDA-graph capture) as it begins and ends, with its time, and a progress bar for
a phase that counts its steps. The phases are read from tritonserver's log file as it grows
(the stub hands the engine's log to Triton's), and from this process's own ``slipstream``
logger for what serve does itself (converting the default model)."""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional, TextIO

from slipstream.server.launch.server_log import ServerLog
from slipstream.startup_log import Event, PhaseEvent, parse

NAME_WIDTH = 20  # the longest phase name, "CUDA-graph capture", and a space


def describe(detail: dict[str, Any]) -> str:
    """What a phase made, in words (the KV cache's blocks, the weights' format ...)."""
    if "blocks" in detail:
        return f"{detail['blocks']} blocks of {detail.get('block_size', '?')} tokens, " + (
            f"{detail.get('mib', '?')} MiB"
        )
    shown = [str(detail[k]) for k in ("weights", "model", "directory") if k in detail]
    return ", ".join(shown)


class StartupReport:
    """Prints phase events as they come; ``poll`` reads what the server log added since."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self.offset: Optional[int] = None  # read position in the server log
        self.partial = b""  # a line not yet ended
        self.bars: dict[str, Any] = {}  # phase -> its tqdm bar

    def poll(self, log: ServerLog) -> None:
        """Report the phases the server log announced since the last call (this run only)."""
        if self.offset is None:
            self.offset = log.run_start
        data = log.since(self.offset)
        if not data:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            event = parse(line.decode(errors="replace"))
            if event is not None:
                self.show(event)

    def show(self, event: PhaseEvent) -> None:
        if event.event is Event.START:
            if event.total > 1:
                self.bars[event.phase] = self._bar(event)
            else:
                self._print(f"  ... {event.phase}")
        elif event.event is Event.PROGRESS and event.phase in self.bars:
            bar = self.bars[event.phase]
            bar.update(event.done - bar.n)
        elif event.event is Event.END:
            bar = self.bars.pop(event.phase, None)
            if bar is not None:
                bar.close()
            made = describe(event.detail)
            self._print(
                f"  {event.phase:<{NAME_WIDTH}}{event.seconds:7.1f} s"
                + (f"  ({made})" if made else "")
            )

    def _bar(self, event: PhaseEvent) -> Any:
        from tqdm import tqdm

        return tqdm(total=event.total, desc=f"  {event.phase}", file=self.out, leave=False)

    def _print(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def handler(self) -> logging.Handler:
        """A handler for this process's ``slipstream`` logger that shows its phase lines."""
        report = self

        class PhaseLines(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                event = parse(record.getMessage())
                if event is not None:
                    report.show(event)

        return PhaseLines(logging.INFO)
