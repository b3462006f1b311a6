"""Which device a Triton model instance's engine runs on.

Triton renders ``instance_group [{kind: KIND_GPU, count: 1, gpus: [0, 1]}]`` as one instance per
listed GPU (``count`` per GPU) and tells each its own in the ``initialize`` arguments
(``model_instance_kind`` "GPU", ``model_instance_device_id``). As Triton's vLLM backend does,
a ``KIND_GPU`` instance's engine runs on that GPU whatever the model's ``device`` setting
names; ``KIND_MODEL`` (the model picks, as the shipped configs use) and ``KIND_CPU`` keep
``device``. A ``KIND_GPU`` instance of a model configured for ``cpu`` is refused.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

log = logging.getLogger("slipstream")


def instance_device(args: Mapping[str, Any], device: str) -> str:
    """The engine's ``device`` for the instance Triton's ``args`` describe, given the model's
    ``device`` setting (``auto``, ``cpu``, ``cuda`` or ``cuda:N``)."""
    if str(args.get("model_instance_kind", "")).upper() != "GPU":
        return device
    gpu = f"cuda:{int(args.get('model_instance_device_id', 0))}"
    if device == "cpu":
        raise ValueError(
            f"instance_group kind KIND_GPU puts instance {args.get('model_instance_name', '')!r} "
            "on a GPU but the model's device is cpu: use KIND_CPU or KIND_MODEL, or another device"
        )
    if device.startswith("cuda:") and device != gpu:
        log.warning(
            "device=%s: instance %s runs on %s, the GPU Triton assigned it (KIND_GPU)",
            device,
            args.get("model_instance_name", ""),
            gpu,
        )
    return gpu
