"""KV cache events in vLLM's format, published over ZMQ (``KVEventPublisher``), so routers
that read vLLM's events (vllm-router's ``kv_aware``, llm-d's precise prefix-cache scorer)
can route by where each prompt's blocks are. The engine only queues typed events
(``slipstream.core.kv_cache_events``); encoding and sockets run on the publisher's thread."""
