"""What runs inside Triton's Python-backend stub: the adapter (``adapter.TritonAdapter``),
request intake and parsing, the sender thread and responses, the model's config, metrics,
cancel polls, deadlines, health and the watchdog it leaves beside the stub."""
