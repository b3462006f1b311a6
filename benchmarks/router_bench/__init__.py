"""Several Slipstream replicas behind an existing router, measured: ``python -m router_bench``
(with ``PYTHONPATH=backend:benchmarks``). See docs/benchmarks.md, "Replicas behind a router"."""
