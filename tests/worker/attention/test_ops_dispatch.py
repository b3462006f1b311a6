"""The package and the ops dispatch must work when OpenAI Triton is not installed."""

import subprocess
import sys
import textwrap


def test_dispatch_without_triton_falls_back_to_torch_ops():
    script = textwrap.dedent("""
        import os, sys
        sys.modules["triton"] = None  # import triton -> ImportError, as if not installed
        os.environ.pop("SLIPSTREAM_ATTENTION", None)
        import torch
        import slipstream
        from slipstream.worker import cuda_graphs  # must not need triton either
        from slipstream.worker.attention import dispatch
        from slipstream.worker import kernels
        from slipstream.worker.attention import cpu_backend
        from slipstream.worker.attention import torch_backend as torch_ops
        assert dispatch.get_ops(torch.device("cuda")) is torch_ops
        assert dispatch.get_ops("cpu") is (cpu_backend if kernels.load() else torch_ops)
        assert not dispatch.triton_available()
        os.environ["SLIPSTREAM_ATTENTION"] = "triton"
        try:
            dispatch.get_ops("cuda")
        except RuntimeError as exc:
            assert "triton" in str(exc)
        else:
            raise AssertionError("forcing triton without triton must raise")
        print("OK")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_cpu_kernels_can_be_turned_off():
    script = textwrap.dedent("""
        import os
        os.environ["SLIPSTREAM_CPU_KERNELS"] = "0"
        os.environ.pop("SLIPSTREAM_ATTENTION", None)
        from slipstream.worker.attention import dispatch
        from slipstream.worker.attention import torch_backend as torch_ops
        assert dispatch.get_ops("cpu") is torch_ops
        os.environ["SLIPSTREAM_ATTENTION"] = "cpu"
        try:
            dispatch.get_ops("cpu")
        except RuntimeError as exc:
            assert "SLIPSTREAM_CPU_KERNELS=0" in str(exc)
        else:
            raise AssertionError("forcing the CPU kernel while it is off must raise")
        print("OK")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_every_ops_module_implements_the_attention_ops_interface():
    import inspect

    from slipstream.worker.attention import (
        cpu_backend as cpu_backend,
        torch_backend as torch_ops,
        triton_backend as triton_kernels,
    )
    from slipstream.worker.attention.base import AttentionOps

    for module in (torch_ops, triton_kernels, cpu_backend):
        assert isinstance(module, AttentionOps), module.__name__
        for name in ("store_step_kv", "paged_attention"):
            want = list(inspect.signature(getattr(AttentionOps, name)).parameters)[1:]  # no self
            assert list(inspect.signature(getattr(module, name)).parameters) == want, (
                module.__name__,
                name,
            )
