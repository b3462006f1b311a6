"""The compiled CPU kernels, and CPU attention with them: the ``AttentionOps`` the CPU engine
uses. (The small-GEMM, RMSNorm and rotary kernels built beside them serve the model's layers.)

Decode rows (one new token per sequence), and each token of a speculative verification chunk
as a row of its own, run ``cpu_paged_attention.cpp``, which reads each sequence's K/V blocks
in place from the paged cache: the torch path first gathers every decode sequence's blocks
into a padded copy (in every layer) and then attends over the copy, moving the context twice.
Prompt chunks run ``cpu_prefill_attention.cpp``: tiles of rows against the chunk's blocks in
place, only the causal half of the scores computed (SDPA on a gathered, permuted copy
computes the whole square). A 2,048-token prefill step's attention took 260-300 ms of ~2.55 s
with SDPA and takes ~130 ms with the kernel (AMD EPYC, 2 threads). Softcapped scores and
head sizes other than 16, 32, 64 or 128 keep the torch path for prompt chunks. KV stores
are the torch path's.

The kernels are compiled on first use with the system's C++ compiler against the installed
torch (a few tens of seconds, once) into ``<cache>/cpu_kernels/<key>/``, where the key
covers the sources, torch, the compiler flags and the CPU's flags. ``load()`` returns False,
with the reason logged once, where that fails (no compiler, no headers): the engine then
uses the torch path. ``SLIPSTREAM_CPU_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from slipstream.worker.ops import torch_ops
from slipstream.worker.ops.metadata import AttentionMetadata, AttentionPlan

log = logging.getLogger("slipstream")

ENV_VAR = "SLIPSTREAM_CPU_KERNELS"
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "cpu_paged_attention.cpp",
        "cpu_prefill_attention.cpp",
        "cpu_small_gemm.cpp",
        "cpu_weight_gemm.cpp",
        "cpu_q8_gemm.cpp",
        "cpu_bf16_gemm.cpp",
        "cpu_rms_norm.cpp",
        "cpu_rotary.cpp",
        "cpu_sampling.cpp",
        "cpu_silu_mul.cpp",
        "cpu_logit_stats.cpp",
        "cpu_decode_stack.cpp",
    )
)
HEADERS = tuple(
    Path(__file__).with_name(name)
    for name in ("cpu_parallel.h", "cpu_attention_checks.h", "cpu_vector.h", "cpu_paged_rows.h")
)
# -ffast-math only while compiling (reassociation lets the dot products and exp vectorize);
# linking without it keeps crtfastmath (flush-to-zero for the whole process) out.
COMPILE_FLAGS = (
    "-O3",
    "-march=native",
    "-ffast-math",
    "-fopenmp",
    "-fPIC",
    "-std=c++17",
    "-DNDEBUG",
    "-w",
)
# Kernels that must round exactly as torch's separate operators do: no reassociation and no
# fused multiply-add (a product and a sum each round once, as torch's mul and add do).
EXACT_FLAGS = ("-fno-fast-math", "-ffp-contract=off")
# Kernels whose results must not depend on how the compiler regroups a sum (a prompt row's
# attention must not depend on the tile around it): no reassociation, multiply-adds fused.
ORDERED_FLAGS = ("-fno-fast-math", "-ffp-contract=fast")
# NaN checks must survive (fast-math would fold them away): the sampler's NaN guard reads
# logit_stats' log-sum-exp, and silu_mul keeps a NaN a NaN when it rounds to bf16.
SOURCE_FLAGS = {
    "cpu_rotary.cpp": EXACT_FLAGS,
    "cpu_prefill_attention.cpp": ORDERED_FLAGS,
    "cpu_logit_stats.cpp": ORDERED_FLAGS,
    "cpu_silu_mul.cpp": ORDERED_FLAGS,
}

_lock = threading.Lock()
_state: dict = {}  # "loaded": bool, "error": str


def _cache_root() -> Path:
    from slipstream.worker.model_loader import cache_root

    return cache_root() / "cpu_kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _abi_flag() -> str:
    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def _build_key(compiler: str) -> str:
    h = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in SOURCES + HEADERS),
        torch.__version__.encode(),
        compiler.encode(),
        repr((COMPILE_FLAGS, sorted(SOURCE_FLAGS.items()))).encode(),
        _abi_flag().encode(),
        _cpu_flags().encode(),
    ):
        h.update(part)
    return h.hexdigest()[:16]


def _flags(source: Path) -> tuple:
    return COMPILE_FLAGS + SOURCE_FLAGS.get(source.name, ())


def _build(target: Path, compiler: str) -> None:
    from torch.utils.cpp_extension import include_paths, library_paths

    includes = [f"-I{p}" for p in include_paths()]
    libs = [f"-L{p}" for p in library_paths()]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        lib = Path(tmp) / target.name
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in SOURCES]
        compiles = [
            subprocess.Popen(
                [compiler, *_flags(source), _abi_flag(), *includes, "-c", str(source), "-o", obj],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for source, obj in zip(SOURCES, objects)
        ]
        errors = [proc.communicate()[1] for proc in compiles]  # side by side: ~10 s each
        for proc, err in zip(compiles, errors):  # all finished before the folder goes
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, proc.args, stderr=err)
        # No -fopenmp here: the OpenMP calls resolve to the runtime torch already loaded
        # (a second runtime would bring a second thread pool).
        subprocess.run(
            [compiler, "-shared", *objects, "-o", str(lib), *libs, "-ltorch_cpu", "-lc10"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(lib, target)


def load() -> bool:
    """Compile (once per machine and torch) and load the kernel; False if unavailable."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _load()
        return _state["loaded"]


def _load() -> bool:
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "off", "no"):
        _state["error"] = f"{ENV_VAR}=0"
        return False
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return _unavailable("no C++ compiler (g++) found")
    target = _cache_root() / _build_key(compiler) / "slipstream_cpu_kernels.so"
    try:
        if not target.exists():
            log.info("compiling the CPU kernels (once) into %s", target.parent)
            _build(target, compiler)
        torch.ops.load_library(str(target))
        return True
    except subprocess.CalledProcessError as exc:
        return _unavailable(f"compiling failed: {(exc.stderr or '')[-2000:]}")
    except Exception as exc:  # a broken toolchain or library must not stop the engine
        return _unavailable(repr(exc))


def _unavailable(reason: str) -> bool:
    _state["error"] = reason
    log.warning("CPU attention kernel unavailable, using the torch path: %s", reason)
    return False


def unavailable_reason() -> Optional[str]:
    return _state.get("error")


# The caches the kernels read (bf16 widened exactly as it is read; every sum in fp32).
CACHE_DTYPES = (torch.float32, torch.bfloat16)


def supports(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and load()


# ---------------------------------------------------------------------------- the operators
# A verification chunk (a decoded token and its drafts) runs as one decode-kernel row per
# token, each at its own causal length, reading the blocks in place: exactly the rows plain
# decoding would compute one step at a time. The torch path would gather the sequence's whole
# context and build masks in every layer (~0.3 ms a sequence and layer): a 12-row verification
# step at batch 3-5 took 50-55 ms against 33-35 ms for a plain batch-7 step. Every prompt
# chunk, one token long included, runs on the prefill kernel, whose rows do not depend on the
# chunk or tile around them: a prompt token's result never depends on how the step's budget
# or a prefix-cache hit cut its prompt (outputs independent of the batch).
@dataclass
class _DecodeRows:
    """The step's kernel rows (same in every layer): decode rows and every token of a
    verification chunk, each attending to its sequence's context up to and including itself."""

    rows: torch.Tensor  # [n] int64: their rows in the step's query
    tables: torch.Tensor  # [n, max_blocks] int32
    seq_lens: torch.Tensor  # [n] int32: the context each row sees


@dataclass
class _PromptChunks:
    """The step's prompt chunks for the prefill kernel (same in every layer)."""

    chunks: torch.Tensor  # [C, 3] int64: first row, rows, context length after the chunk
    tables: torch.Tensor  # [C, max_blocks] int32


@dataclass
class _Plan(AttentionPlan):
    decode: Optional[_DecodeRows]
    prompts: Optional[_PromptChunks]
    prompt_indices: list[int]  # the sequences whose new tokens are a prompt chunk
    starts: list[int]  # sequence i's first row
    torch_chunks: Optional[list] = None  # the same chunks for the torch path, made on demand
    # The whole step on the torch path (a dtype the kernel lacks), made on demand.
    torch_plan: Optional[torch_ops.StepPlan] = None


# The prefill kernel's head sizes (ops/cpu_prefill_attention.cpp); others, and softcapped
# scores, take the torch path.
PREFILL_HEAD_DIMS = (16, 32, 64, 128)


@dataclass(frozen=True)
class DecodeStep:
    """A step whose every row is a decode-kernel row (no prompt chunk): what the compiled
    decode stack (``decode_stack``) reads besides the hidden state."""

    decode: _DecodeRows
    store_rows: Optional[torch.Tensor]  # the rows whose K/V is stored (None: every row)
    store_slots: torch.Tensor


def decode_step(meta: AttentionMetadata, key_cache: torch.Tensor) -> Optional[DecodeStep]:
    """The step's kernel rows where the step (planned by ``plan``) is all decode rows over a
    cache the kernel reads; else None."""
    step_plan = meta.plan
    if not isinstance(step_plan, _Plan) or step_plan.decode is None:
        return None
    if step_plan.prompts is not None or key_cache.dtype not in CACHE_DTYPES or not load():
        return None
    return DecodeStep(step_plan.decode, step_plan.store_rows, step_plan.store_slots)


def _kernel_rows(meta: AttentionMetadata, starts: list[int]) -> Optional[_DecodeRows]:
    q_lens, seq_lens = meta.query_lens_host, meta.seq_lens_host
    if meta.decode_only and not any(meta.prompt_host):
        return _DecodeRows(
            torch.tensor(starts[:-1], dtype=torch.long),
            meta.block_tables.to(torch.int32).contiguous(),
            meta.seq_lens.to(torch.int32).contiguous(),
        )
    rows, seqs, lens = [], [], []
    for i, n in enumerate(q_lens):
        if not _on_kernel(meta, i):
            continue
        for j in range(n):  # token j sits at position seq_len - n + j
            rows.append(starts[i] + j)
            seqs.append(i)
            lens.append(seq_lens[i] - n + j + 1)
    if not rows:
        return None
    return _DecodeRows(
        torch.tensor(rows, dtype=torch.long),
        meta.block_tables[torch.tensor(seqs)].to(torch.int32).contiguous(),
        torch.tensor(lens, dtype=torch.int32),
    )


def _on_kernel(meta: AttentionMetadata, i: int) -> bool:
    """Sequence i's rows go to the decode kernel (else: a prompt chunk, the prefill kernel)."""
    if i < len(meta.prompt_host):
        return not meta.prompt_host[i]
    return meta.query_lens_host[i] == 1 or (i < len(meta.verify_host) and meta.verify_host[i])


def _prompt_chunks(
    meta: AttentionMetadata, starts: list[int], indices: list[int]
) -> Optional[_PromptChunks]:
    if not indices:
        return None
    chunks = torch.tensor(
        [[starts[i], meta.query_lens_host[i], meta.seq_lens_host[i]] for i in indices],
        dtype=torch.long,
    )
    tables = meta.block_tables[torch.tensor(indices)].to(torch.int32).contiguous()
    return _PromptChunks(chunks, tables)


def _build_plan(meta: AttentionMetadata) -> _Plan:
    starts = [0]
    for n in meta.query_lens_host:
        starts.append(starts[-1] + n)
    indices = [i for i in range(len(meta.query_lens_host)) if not _on_kernel(meta, i)]
    store_rows, store_slots = torch_ops.stored_rows(meta)
    return _Plan(
        store_rows,
        store_slots,
        _kernel_rows(meta, starts),
        _prompt_chunks(meta, starts, indices),
        indices,
        starts,
    )


def plan(meta: AttentionMetadata, key_cache: torch.Tensor, num_query_heads: int) -> _Plan:
    """``AttentionOps.plan``: the kernel rows, prompt chunks and stored rows of the step."""
    return _build_plan(meta)


def _plan_for(meta: AttentionMetadata) -> _Plan:
    """The runner's plan, or for a caller that planned none one made now and kept."""
    if meta.plan is None:
        meta.plan = _build_plan(meta)
    return meta.plan if isinstance(meta.plan, _Plan) else _build_plan(meta)


def _torch_plan(
    plan: _Plan, meta: AttentionMetadata, key_cache: torch.Tensor, group: int
) -> torch_ops.StepPlan:
    if plan.torch_plan is None:
        plan.torch_plan = torch_ops.build_plan(meta, key_cache, group)
    return plan.torch_plan


def _torch_chunks(plan: _Plan, meta: AttentionMetadata, group: int, block_size: int) -> list:
    if plan.torch_chunks is None:
        plan.torch_chunks = [
            torch_ops._prefill_chunk(
                plan.starts[i],
                meta.query_lens_host[i],
                meta.seq_lens_host[i],
                meta.block_tables[i : i + 1],
                group,
                block_size,
            )
            for i in plan.prompt_indices
        ]
    return plan.torch_chunks


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """``AttentionOps.paged_attention``: decode rows and verification chunks by the decode
    kernel, prompt chunks by the prefill kernel (by torch with a softcap or an odd head size)."""
    if not supports(query.dtype) or key_cache.dtype not in CACHE_DTYPES:
        if not isinstance(meta.plan, _Plan):
            return torch_ops.paged_attention(
                query, key_cache, value_cache, meta, scale, sliding_window, softcap
            )
        group = query.shape[1] // key_cache.shape[2]  # the runner planned for the kernel
        return torch_ops.run_plan(
            query,
            key_cache,
            value_cache,
            _torch_plan(meta.plan, meta, key_cache, group),
            scale,
            sliding_window,
            softcap,
        )
    plan = _plan_for(meta)
    out = torch.empty_like(query)
    if plan.decode is not None:
        d = plan.decode
        torch.ops.slipstream_cpu.paged_decode_attention(
            out,
            query,
            key_cache,
            value_cache,
            d.tables,
            d.seq_lens,
            d.rows,
            float(scale),
            int(sliding_window or 0),
            float(softcap or 0.0),
        )
    if plan.prompts is None:
        return out
    if not softcap and query.shape[-1] in PREFILL_HEAD_DIMS:
        torch.ops.slipstream_cpu.paged_prefill_attention(
            out,
            query,
            key_cache,
            value_cache,
            plan.prompts.tables,
            plan.prompts.chunks,
            float(scale),
            int(sliding_window or 0),
        )
        return out
    for chunk in _torch_chunks(
        plan, meta, query.shape[1] // key_cache.shape[2], key_cache.shape[1]
    ):
        torch_ops._run_prefill(
            query, key_cache, value_cache, chunk, scale, sliding_window, softcap, out
        )
    return out


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **_,
) -> torch.Tensor:
    """One query token per sequence, ``[B, H, D]`` (the kernel alone; tests and tools)."""
    out = torch.empty_like(query)
    rows = torch.arange(query.shape[0], dtype=torch.long)
    torch.ops.slipstream_cpu.paged_decode_attention(
        out,
        query,
        key_cache,
        value_cache,
        block_tables.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        rows,
        float(scale),
        int(sliding_window or 0),
        float(softcap or 0.0),
    )
    return out


store_kv = torch_ops.store_kv
store_step_kv = torch_ops.store_step_kv
paged_prefill_attention = torch_ops.paged_prefill_attention
