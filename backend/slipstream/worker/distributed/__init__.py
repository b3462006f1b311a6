"""Tensor parallelism's worker side: how a model is split over ranks (``partition``,
``sharding``), the ranks' torch.distributed group (``process_group``), and what crosses from
rank 0 to the others each step (``step_plan``, ``plan_channel``). The processes themselves
are started and watched by ``slipstream.engine.executor``."""
