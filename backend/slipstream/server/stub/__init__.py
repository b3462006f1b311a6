"""What runs inside Triton's Python-backend stub: the adapter (``triton_model``), request
parsing and responses, the model's config, metrics, cancel polls, deadlines, health, the
watchdog it leaves beside the stub."""
