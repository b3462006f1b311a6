"""How a tensor-parallel group's failure reaches the engine."""


class GroupFailure(RuntimeError):
    """The ranks of a tensor-parallel group can no longer run a step together (one died,
    hung, failed or could not be reached): no request can be served until the engine and
    its group are built again. Never retried request by request."""
