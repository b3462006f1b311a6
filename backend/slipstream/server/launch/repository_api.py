"""Triton's model-repository API as the launcher uses it to stop a server cleanly: the index of
model states, and unloading every model while the server is fully up, then waiting until each
has finalized (its in-flight requests finished or ended with an error).

The API is restricted (``--http-restricted-api`` / ``--grpc-restricted-protocol``) to a random
key the launcher alone holds and sends as ``MODEL_CONTROL_HEADER`` with its own calls, unless
the operator opened it: with the Python backend a loadable model directory is code execution,
and an unload takes the model away from every client.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional

from slipstream.server.launch.scrape import matching, scrape

# The header (HTTP) / metadata key (gRPC) that unlocks Triton's model-repository API (load,
# unload, index) when it is restricted: its value is a random key only the launcher knows.
MODEL_CONTROL_HEADER = "slipstream-model-control-key"
# An unloading model with nothing in flight for this long will not finalize (see unload_all).
STUCK_UNLOAD_S = 3.0
# States of a model that is (or may become) loaded: what an unload waits out.
LIVE_STATES = ("READY", "LOADING", "UNLOADING")
IN_FLIGHT_SERIES = ("slipstream_requests_running", "slipstream_requests_waiting")


@dataclass
class RepositoryAPI:
    http_url: str  # host:port
    metrics_url: str
    key: Optional[str]  # None: the API is open (an operator's explicit choice)

    def post(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        headers = {MODEL_CONTROL_HEADER: self.key} if self.key is not None else {}
        req = urllib.request.Request(
            f"http://{self.http_url}{path}", data=b"", method="POST", headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except (urllib.error.URLError, OSError) as e:
            return 0, str(e)

    def model_states(self) -> dict[str, str]:
        """name -> state ("READY", "UNLOADING", "UNAVAILABLE", ...) from the repository index."""
        status, body = self.post("/v2/repository/index")
        if status != 200:
            return {}
        return {m["name"]: m.get("state", "") for m in json.loads(body)}

    def requests_in_flight(self) -> Optional[float]:
        """Running + waiting requests of the slipstream models (their metrics); None if unknown."""
        try:
            samples = scrape(self.metrics_url, timeout=2)
        except (urllib.error.URLError, OSError, ValueError):
            return None
        values = [s.value for name in IN_FLIGHT_SERIES for s in matching(samples, name)]
        return float(sum(values)) if values else None

    def unload_all(
        self, deadline: float, running: Callable[[], bool], finalizing: Callable[[], bool]
    ) -> str:
        """Unload every loaded model and wait: "unloaded" once each has finalized, "stuck"
        when one will not (below), "timeout" at the deadline."""
        for name, state in self.model_states().items():
            if state in ("READY", "LOADING"):
                self.post(
                    f"/v2/repository/models/{name}/unload",
                    timeout=max(deadline - time.monotonic(), 1.0),
                )
        idle_since: Optional[float] = None
        while time.monotonic() < deadline and running():
            states = self.model_states()
            if states and all(state not in LIVE_STATES for state in states.values()):
                return "unloaded"
            # Triton 2.51 can keep a model referenced for ever after a gRPC stream was
            # cancelled (a race fixed upstream in 25.05): nothing left to finish, yet no
            # finalize. Waiting for the deadline would only delay the kill.
            idle = self.requests_in_flight() == 0 and not finalizing()
            idle_since = (idle_since or time.monotonic()) if idle else None
            if idle_since is not None and time.monotonic() - idle_since > STUCK_UNLOAD_S:
                return "stuck"
            time.sleep(0.1)
        return "timeout"
