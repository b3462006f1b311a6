"""What every test gets: OpenAI Triton on its CPU interpreter, and the `server` marker's guard."""

import os

# OpenAI Triton reads TRITON_INTERPRET when @triton.jit decorates (i.e. at import): run kernels
# on CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

# server_guard: a test not marked `server` that starts a tritonserver fails (server_guard.py).
# pytester: the guard's own test (test_server_guard.py) runs pytest on a module of its own.
pytest_plugins = ("server_guard", "pytester")
