"""Tensor parallelism's processes: rank 0 in the engine's process (``leader``), the other
ranks as processes of their own (``rank_main`` / ``rank_worker``, started by
``rank_processes``), and a machine that serves no requests, only ranks (``headless``)."""
