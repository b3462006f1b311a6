"""CPU attention on the compiled kernels (``worker/kernels``): the ``AttentionOps`` the CPU
engine uses.

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

Where the kernels cannot be built the engine runs ``torch_backend`` instead (``dispatch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from slipstream.worker import kernels
from slipstream.worker.attention import torch_backend
from slipstream.worker.attention.layer import AttentionLayer
from slipstream.worker.attention.metadata import (
    AttentionMetadata,
    AttentionPlan,
    DecodeRows,
    DecodeStep,
)

# The caches the kernels read (bf16 widened exactly as it is read; every sum in fp32).
CACHE_DTYPES = (torch.float32, torch.bfloat16)


def supports(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and kernels.load()


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
class _PromptChunks:
    """The step's prompt chunks for the prefill kernel (same in every layer)."""

    chunks: torch.Tensor  # [C, 3] int64: first row, rows, context length after the chunk
    tables: torch.Tensor  # [C, max_blocks] int32


@dataclass
class _Plan(AttentionPlan):
    decode: Optional[DecodeRows]
    prompts: Optional[_PromptChunks]
    prompt_indices: list[int]  # the sequences whose new tokens are a prompt chunk
    starts: list[int]  # sequence i's first row
    torch_chunks: Optional[list] = None  # the same chunks for the torch path, made on demand
    # The whole step on the torch path (a dtype the kernel lacks), made on demand.
    torch_plan: Optional[torch_backend.StepPlan] = None
    kernel_cache: bool = False  # the kernels are loaded and read the cache's dtype

    def decode_step(self) -> Optional[DecodeStep]:
        """The step's kernel rows where every row is a decode-kernel row over a cache the
        kernel reads (what the compiled decode stack runs); else None."""
        if self.decode is None or self.prompts is not None or not self.kernel_cache:
            return None
        return DecodeStep(self.decode, self.store_rows, self.store_slots)


# The prefill kernel's head sizes (kernels/csrc/cpu_prefill_attention.cpp); others, and softcapped
# scores, take the torch path.
PREFILL_HEAD_DIMS = (16, 32, 64, 128)


def _kernel_rows(meta: AttentionMetadata, starts: list[int]) -> Optional[DecodeRows]:
    q_lens, seq_lens = meta.query_lens_host, meta.seq_lens_host
    if meta.decode_only and not any(meta.prompt_host):
        return DecodeRows(
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
    return DecodeRows(
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


def _build_plan(meta: AttentionMetadata, key_cache: Optional[torch.Tensor] = None) -> _Plan:
    starts = [0]
    for n in meta.query_lens_host:
        starts.append(starts[-1] + n)
    indices = [i for i in range(len(meta.query_lens_host)) if not _on_kernel(meta, i)]
    store_rows, store_slots = torch_backend.stored_rows(meta)
    return _Plan(
        store_rows,
        store_slots,
        _kernel_rows(meta, starts),
        _prompt_chunks(meta, starts, indices),
        indices,
        starts,
        kernel_cache=key_cache is not None and key_cache.dtype in CACHE_DTYPES and kernels.load(),
    )


def plan(meta: AttentionMetadata, key_cache: torch.Tensor, num_query_heads: int) -> _Plan:
    """``AttentionOps.plan``: the kernel rows, prompt chunks and stored rows of the step."""
    return _build_plan(meta, key_cache)


def _plan_for(meta: AttentionMetadata) -> _Plan:
    """The runner's plan, or for a caller that planned none one made now and kept."""
    if meta.plan is None:
        meta.plan = _build_plan(meta)
    return meta.plan if isinstance(meta.plan, _Plan) else _build_plan(meta)


def _torch_plan(
    plan: _Plan, meta: AttentionMetadata, key_cache: torch.Tensor, group: int
) -> torch_backend.StepPlan:
    if plan.torch_plan is None:
        plan.torch_plan = torch_backend.build_plan(meta, key_cache, group)
    return plan.torch_plan


def _torch_chunks(plan: _Plan, meta: AttentionMetadata, group: int, block_size: int) -> list:
    if plan.torch_chunks is None:
        plan.torch_chunks = [
            torch_backend.prefill_chunk(
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
    query: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata
) -> torch.Tensor:
    """``AttentionOps.paged_attention``: decode rows and verification chunks by the decode
    kernel, prompt chunks by the prefill kernel (by torch with a softcap or an odd head size)."""
    group = query.shape[1] // layer.key_cache.shape[2]
    if not supports(query.dtype) or layer.key_cache.dtype not in CACHE_DTYPES:
        if not isinstance(meta.plan, _Plan):
            return torch_backend.paged_attention(query, layer, meta)
        # the runner planned for the kernel
        torch_plan = _torch_plan(meta.plan, meta, layer.key_cache, group)
        return torch_backend.run_plan(query, layer, torch_plan)
    plan = _plan_for(meta)
    out = torch.empty_like(query)
    if plan.decode is not None:
        d = plan.decode
        _decode_kernel(out, query, layer, d.tables, d.seq_lens, d.rows)
    if plan.prompts is None:
        return out
    if not layer.softcap and query.shape[-1] in PREFILL_HEAD_DIMS:
        torch.ops.slipstream_cpu.paged_prefill_attention(
            out,
            query,
            layer.key_cache,
            layer.value_cache,
            plan.prompts.tables,
            plan.prompts.chunks,
            float(layer.scale),
            layer.window,
        )
        return out
    for chunk in _torch_chunks(plan, meta, group, layer.key_cache.shape[1]):
        torch_backend.run_prefill(query, layer, chunk, out)
    return out


def paged_decode_attention(
    query: torch.Tensor,
    layer: AttentionLayer,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    **_,
) -> torch.Tensor:
    """One query token per sequence, ``[B, H, D]`` (the kernel alone; tests and tools)."""
    out = torch.empty_like(query)
    rows = torch.arange(query.shape[0], dtype=torch.long)
    tables = block_tables.to(torch.int32).contiguous()
    _decode_kernel(out, query, layer, tables, seq_lens.to(torch.int32).contiguous(), rows)
    return out


def _decode_kernel(
    out: torch.Tensor,
    query: torch.Tensor,
    layer: AttentionLayer,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """``cpu_paged_attention.cpp``: query row ``rows[i]`` attends to its sequence's context
    (``tables[i]``, ``seq_lens[i]`` tokens) into the same row of ``out``."""
    torch.ops.slipstream_cpu.paged_decode_attention(
        out,
        query,
        layer.key_cache,
        layer.value_cache,
        tables,
        seq_lens,
        rows,
        float(layer.scale),
        layer.window,
        layer.cap,
    )


store_kv = torch_backend.store_kv
store_step_kv = torch_backend.store_step_kv
paged_prefill_attention = torch_backend.paged_prefill_attention
