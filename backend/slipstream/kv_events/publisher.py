"""The ZMQ side of KV events, as vLLM's ``ZmqEventPublisher`` behaves on the wire: a PUB
socket sends ``(topic, sequence as 8 bytes big-endian, msgpack EventBatch)``; an optional
ROUTER socket answers ``(identity, b"", start sequence)`` with every buffered batch from
that sequence on, then ``(identity, b"", b"", -1 as 8 bytes, b"")``.

Off the step path: ``publish`` only puts the step's events on a bounded queue (full: the
batch is dropped and counted, the engine never waits); one thread encodes and sends. The
PUB socket never blocks either: a subscriber past the high-water mark loses batches.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Optional

import zmq

from slipstream.core.kv_cache_events import KVCacheEvent
from slipstream.kv_events.config import KVEventsConfig
from slipstream.kv_events.wire import WireFormat, encoder, use_int_hashes

log = logging.getLogger("slipstream")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard addresses, ipc:// and inproc:// bind; the rest connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(
        self,
        config: KVEventsConfig,
        *,
        lora_ids: Optional[dict[str, int]] = None,
        data_parallel_rank: int = 0,
        context: Optional[zmq.Context] = None,
    ) -> None:
        self.config = config
        self.wire = WireFormat(use_int_hashes(), dict(lora_ids or {}), data_parallel_rank)
        self._queue: "queue.Queue[Optional[tuple[float, list[KVCacheEvent]]]]" = queue.Queue(
            maxsize=config.max_queue_size
        )
        self._buffer: "collections.deque[tuple[int, bytes]]" = collections.deque(
            maxlen=config.buffer_steps
        )
        self._topic = config.topic.encode()
        self._next_seq = 0
        self.dropped = 0  # batches lost because the queue was full
        self._ctx = context or zmq.Context()
        self._own_ctx = context is None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: Optional[zmq.Socket] = None
        try:
            self.endpoint = self._attach(self._pub, config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint: Optional[str] = self._bind(
                    self._replay, config.replay_endpoint
                )
            else:
                self.replay_endpoint = None
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(
                f"kv_events_config: cannot open {config.endpoint!r} / "
                f"{config.replay_endpoint!r}: {e}"
            ) from None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slipstream-kv-events", daemon=True)
        self._thread.start()
        log.info(
            "KV events: publishing on %s (replay %s, topic %r)",
            self.endpoint,
            self.replay_endpoint,
            config.topic,
        )

    # -- the engine's side ------------------------------------------------------------------
    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events; never blocks."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("KV events: queue full, %d batches dropped", self.dropped)

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to ``timeout``), then close the sockets."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._close_sockets()

    # -- sockets ------------------------------------------------------------------------------
    def _attach(self, sock: zmq.Socket, endpoint: str) -> str:
        if is_bind_endpoint(endpoint):
            return self._bind(sock, endpoint)
        sock.connect(endpoint)
        return endpoint

    @staticmethod
    def _bind(sock: zmq.Socket, endpoint: str) -> str:
        """Bind; returns the bound address (a tcp port 0 becomes the port chosen). An IPv6
        address (``tcp://[::1]:PORT`` binds by vLLM's rule: loopback only) needs ZMQ's IPv6
        switch."""
        if "[" in endpoint or "::" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(endpoint)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    # -- the publisher thread -----------------------------------------------------------------
    def _run(self) -> None:
        pack = encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stopped.is_set():
                    return
                continue
            if item is None:
                return
            try:
                payload = pack.encode(self.wire.batch(*item))
                seq = self._next_seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq, payload), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the subscriber's queue is full: this batch is lost to it alone
            except Exception:  # noqa: BLE001 - one bad batch must not end publishing
                log.exception("KV events: cannot publish a batch")
                continue
            self._buffer.append((self._next_seq, payload))
            self._next_seq += 1

    def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None  # polled only when replay is on
        frames = replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: bad replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))
