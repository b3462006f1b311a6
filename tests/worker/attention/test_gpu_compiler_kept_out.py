"""A serving process on a machine without CUDA keeps OpenAI Triton from loading (torch would
load it for dynamo's GPU check as soon as transformers' model code imports torch._dynamo:
66 MB resident a CPU engine never uses). Each case runs in a fresh interpreter."""

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine loads Triton")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_a_cpu_process_loads_the_model_code_without_triton():
    proc = _run(
        "import sys, torch\n"
        "from slipstream.worker.device import keep_gpu_compiler_out\n"
        "assert keep_gpu_compiler_out(torch.device('cpu'))\n"
        "import transformers.models.llama.modeling_llama\n"
        "assert sys.modules['triton'] is None, 'triton was loaded'\n"
        "try:\n"
        "    import triton\n"
        "except ImportError:\n"
        "    print('kept out')\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "kept out"


def test_nothing_is_kept_out_for_cuda_or_once_triton_is_loaded():
    pytest.importorskip("triton")
    proc = _run(
        "import torch, triton\n"
        "from slipstream.worker.device import keep_gpu_compiler_out\n"
        "assert not keep_gpu_compiler_out(torch.device('cuda'))\n"
        "assert not keep_gpu_compiler_out(torch.device('cpu'))  # already loaded\n"
        "import sys; assert sys.modules['triton'] is triton\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
