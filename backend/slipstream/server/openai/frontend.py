"""Run the OpenAI-compatible API (uvicorn) on a thread of the launcher's process, beside the
tritonserver it talks to; port 0 picks a free port (``port`` tells which)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from slipstream.server.openai.api_settings import ApiSettings
from slipstream.server.openai.http_limits import bounded_h11
from slipstream.server.openai.served_models import ModelTable, ServedModel, served_models

if TYPE_CHECKING:
    from slipstream.server.openai.app import OpenAIApp


class OpenAIFrontendError(RuntimeError):
    pass


class OpenAIFrontend:
    def __init__(
        self,
        models: Sequence[ServedModel],
        grpc_url: str,
        *,
        metrics_url: Optional[str] = None,
        host: str = "127.0.0.1",
        port: int = 0,
        settings: Optional[ApiSettings] = None,
        pooling: Optional[dict[str, Any]] = None,
    ) -> None:
        self.table = ModelTable(models)
        self.grpc_url, self.metrics_url = grpc_url, metrics_url
        self.host, self.port = host, port
        self.settings = settings or ApiSettings()
        self.pooling = pooling  # --pooler-config
        self.api: Optional["OpenAIApp"] = None  # once started
        self._server: Optional[Any] = None  # uvicorn.Server (imported when started)
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def for_repository(
        cls,
        repo: Path,
        grpc_url: str,
        aliases: Sequence[str] = (),
        served_names: Sequence[str] = (),
        **kwargs,
    ) -> "OpenAIFrontend":
        return cls(served_models(Path(repo), aliases, served_names), grpc_url, **kwargs)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "OpenAIFrontend":
        import uvicorn

        from slipstream.server.openai.app import OpenAIApp

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self.api = OpenAIApp(
            self.table, self.grpc_url, self.metrics_url, self.settings, self.pooling
        )
        limits = self.settings
        config = uvicorn.Config(
            self.api.asgi,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
            http=bounded_h11(
                limits.header_timeout_s, limits.max_header_bytes, limits.max_connections
            ),
            h11_max_incomplete_event_size=limits.max_header_bytes,
        )
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="slipstream-openai", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OpenAIFrontendError(f"the OpenAI API did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._server = self._thread = None

    def __enter__(self) -> "OpenAIFrontend":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
