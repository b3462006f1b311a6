"""What every test gets: its device tier (device_tier.py: `pytest --device cuda` is the GPU tier;
the default runs OpenAI Triton's kernels on its CPU interpreter) and the `server` marker's guard
(server_guard.py: a test not marked `server` that starts a tritonserver fails). pytester: the
guard's own test (test_server_guard.py) runs pytest on a module of its own."""

pytest_plugins = ("device_tier", "server_guard", "pytester")
