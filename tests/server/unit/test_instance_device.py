"""One GPU per Triton model instance: ``KIND_GPU`` instances' engines run on the GPU Triton
assigns each (``model_instance_device_id``), as Triton's vLLM backend places them;
``KIND_MODEL`` and ``KIND_CPU`` keep the model's ``device``.

tritonserver refuses ``KIND_GPU`` on a machine without GPUs, so the instances are rendered here
as Triton renders an instance group: ``count`` instances on each listed GPU, each told its kind
and device in the ``initialize`` arguments."""

from __future__ import annotations

import pytest

from slipstream import EngineConfig
from slipstream.server.stub.instance_device import instance_device
from slipstream.worker.device import DeviceSettings


def triton_instances(model: str, kind: str, count: int, gpus: list[int]) -> list[dict]:
    """The ``initialize`` arguments of each instance Triton makes for one instance group."""
    if kind != "KIND_GPU":
        return [
            {
                "model_instance_kind": kind.removeprefix("KIND_"),
                "model_instance_device_id": "0",
                "model_instance_name": f"{model}_0_{i}",
            }
            for i in range(count)
        ]
    return [
        {
            "model_instance_kind": "GPU",
            "model_instance_device_id": str(gpu),
            "model_instance_name": f"{model}_0_{n * count + i}",
        }
        for n, gpu in enumerate(gpus)
        for i in range(count)
    ]


def engine_devices(instances: list[dict], device: str) -> list[str]:
    configs = [EngineConfig(device=instance_device(args, device)) for args in instances]
    return [str(DeviceSettings.resolve(c).device) for c in configs]


@pytest.mark.parametrize("device", ["auto", "cuda", "cuda:0"])
def test_two_kind_gpu_instances_on_gpus_0_and_1_get_one_gpu_each(device):
    instances = triton_instances("slipstream", "KIND_GPU", 1, [0, 1])
    assert len(instances) == 2
    assert engine_devices(instances, device) == ["cuda:0", "cuda:1"]


def test_count_two_on_each_gpu_puts_two_engines_on_each():
    instances = triton_instances("slipstream", "KIND_GPU", 2, [0, 1])
    assert engine_devices(instances, "auto") == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]


@pytest.mark.parametrize("kind", ["KIND_MODEL", "KIND_CPU"])
@pytest.mark.parametrize("device", ["auto", "cpu", "cuda:1"])
def test_kind_model_and_cpu_keep_the_models_device(kind, device):
    for args in triton_instances("slipstream", kind, 2, []):
        assert instance_device(args, device) == device


def test_a_kind_gpu_instance_of_a_cpu_model_is_refused():
    with pytest.raises(ValueError, match="KIND_GPU .* device is cpu"):
        instance_device(triton_instances("m", "KIND_GPU", 1, [0])[0], "cpu")
