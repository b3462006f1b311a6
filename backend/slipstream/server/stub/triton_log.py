"""The engine's log (the ``slipstream`` logger: kernel build, which CPU path runs, start-up
phases, warnings) handed to Triton's own log through ``pb_utils.Logger``, so it lands where
Triton's lines do (its log file, or stdout in a container) with Triton's prefix and level.

Installed once per stub process, at the model's ``initialize``; without it the engine's lines
had no handler at all inside Triton."""

from __future__ import annotations

import logging
from typing import Any

ENGINE_LOGGER = "slipstream"


class TritonLogHandler(logging.Handler):
    """A ``logging.Handler`` writing through ``pb_utils.Logger`` (its ``log_*`` methods)."""

    def __init__(self, triton_logger: Any) -> None:
        super().__init__(logging.INFO)
        self.triton_logger = triton_logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            if record.levelno >= logging.ERROR:
                self.triton_logger.log_error(message)
            elif record.levelno >= logging.WARNING:
                self.triton_logger.log_warn(message)
            elif record.levelno >= logging.INFO:
                self.triton_logger.log_info(message)
            else:
                self.triton_logger.log_verbose(message)
        except Exception:  # a log line must never take a request or the engine down
            self.handleError(record)


def forward_to_triton(triton_logger: Any) -> TritonLogHandler:
    """Attach (once) a handler for the engine's logger; INFO and above are kept unless the
    logger was given a level already."""
    logger = logging.getLogger(ENGINE_LOGGER)
    for handler in logger.handlers:
        if isinstance(handler, TritonLogHandler):
            return handler
    handler = TritonLogHandler(triton_logger)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    return handler
