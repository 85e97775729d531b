"""Hopper and Ampere decode: FlashInfer's ``BatchMLAPagedAttentionWrapper`` with the fa3 (SM90) or fa2 (SM80+) kernel.

The wrapper reads the cache through a page table. With a page size of 1 the "pages" are the cache's own rows,
so any layout Transformers keeps (DynamicCache, StaticCache with its unfilled tail, this package's
`MLALatentCache`) is read in place: row ``b * pitch + j`` is token ``j`` of sequence ``b``, and only the
positions the step's mask marks valid are listed, which is how left padding and the static cache's unfilled
tail are skipped. Nothing of the history is copied.

Planning (host-side work, milliseconds) happens once per step and device, at the first layer, through the
step's `StepPlan`; every layer then only runs the kernel. One wrapper per device, backend, head count and dtype
is kept for the process, over the device's one float workspace (``buffers.py``). (FlashInfer 0.7.2 still builds a
new planned backend, with its own staging buffers, on every ``plan``: that is most of the ~1 ms planning cost.)
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import weakref

import torch
from torch._guards import TracingContext

from .buffers import workspace_buffer
from .metadata import StepPlan

_wrappers: dict[tuple, object] = {}


def fa_wrapper(device: torch.device, backend: str, num_heads: int, dtype: torch.dtype):
    """The process-wide (eager-mode) wrapper of this device, backend, head count and dtype."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    key = (device, backend, num_heads, dtype)
    if key not in _wrappers:
        _wrappers[key] = BatchMLAPagedAttentionWrapper(workspace_buffer(device), backend=backend)
    return _wrappers[key]


def cache_rows(latent: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[B, 1, S, D]`` cache view -> (``[rows, 1, D]`` view of its storage, pitch in rows between sequences)."""
    if latent.stride(-1) != 1:
        raise ValueError("the latent cache must be contiguous in its last dimension")
    row = latent.stride(2)
    if latent.stride(0) % row:
        raise ValueError(f"cache batch stride {latent.stride(0)} is not a whole number of rows of {row}")
    pitch = latent.stride(0) // row if latent.shape[0] > 1 else latent.shape[2]
    rows = (latent.shape[0] - 1) * pitch + latent.shape[2]
    return latent.as_strided((rows, 1, latent.shape[-1]), (row, row, 1), latent.storage_offset()), pitch


def csr_metadata(valid: torch.Tensor, pitch: int, q_len: int):
    """Page-size-1 CSR metadata for the positions marked in ``valid [B, S]``.

    Returns ``qo_indptr``, ``kv_indptr`` and the KV lengths on the host (FlashInfer's planner reads them there)
    and ``kv_indices`` on ``valid``'s device, at the cost of one device-to-host copy of ``B`` lengths. Rows whose
    valid positions form one run (left padding, a static cache's unfilled tail: every mask Transformers builds)
    are indexed arithmetically; any other pattern goes through ``nonzero``.
    """
    b, s = valid.shape
    device = valid.device
    lens = valid.sum(-1, dtype=torch.int32)
    first = valid.int().argmax(-1)  # 0 for an empty row, whose length is 0 anyway
    last = s - 1 - valid.flip(-1).int().argmax(-1)
    one_run = (lens == 0) | (last - first + 1 == lens)
    host = torch.stack([lens, one_run.int()]).cpu()  # the one synchronisation of the step's planning
    lens_host = host[0]
    kv_indptr = torch.zeros(b + 1, dtype=torch.int32)
    kv_indptr[1:] = lens_host.cumsum(0)
    qo_indptr = torch.arange(b + 1, dtype=torch.int32) * q_len
    if bool(host[1].all()):
        total = int(kv_indptr[-1])
        p = torch.arange(total, device=device, dtype=torch.int64)
        starts = kv_indptr.to(device, non_blocking=True).long()
        row = torch.searchsorted(starts[1:], p, right=True)
        kv_indices = (row * pitch + first.long()[row] + p - starts[row]).to(torch.int32)
    else:
        batch_idx, pos = valid.nonzero(as_tuple=True)
        kv_indices = (batch_idx * pitch + pos).to(torch.int32)
    return qo_indptr, kv_indptr, kv_indices, lens_host


def plan_wrapper(wrapper, plan: StepPlan, device, pitch, num_heads, dtype, rank, rope, scale) -> None:
    """Host-side FlashInfer planning of `wrapper` for one step (one device sync for the indices)."""
    from flashinfer.mla import MLAPlanMetadata

    qo_indptr, kv_indptr, kv_indices, lens = csr_metadata(plan.kv_valid(device), pitch, plan.q_len)
    wrapper.plan(
        metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, lens),
        num_heads=num_heads,
        head_dim_ckv=rank,
        head_dim_kpe=rope,
        page_size=1,
        causal=plan.q_len > 1,
        sm_scale=scale,
        q_data_type=dtype,
        kv_data_type=dtype,
        query_layout="split",
        kv_cache_layout="split",
    )


def fa_decode(backend, plan, q_lat, q_pe, kv_latent, k_rot, scale):
    """``[B, H, Sq, L]`` latent query -> ``[B, H, Sq, L]`` latent output on fa3 or fa2."""
    b, h, sq, rank = q_lat.shape
    rope = q_pe.shape[-1]
    device = q_lat.device
    ckv, pitch = cache_rows(kv_latent)
    kpe, kpe_pitch = cache_rows(k_rot)
    if kpe_pitch != pitch:
        raise ValueError(f"latent and rope caches disagree on the row pitch ({pitch} vs {kpe_pitch})")
    wrapper = fa_wrapper(device, backend, h, q_lat.dtype)
    # Planned by the first layer of each step; the wrapper remembers for which step (and cache layout) it is.
    planned_for = (pitch, scale, rank, rope)
    if getattr(wrapper, "_hf_mla_step", None) is not plan or wrapper._hf_mla_planned_for != planned_for:
        plan_wrapper(wrapper, plan, device, pitch, h, q_lat.dtype, rank, rope, scale)
        wrapper._hf_mla_step, wrapper._hf_mla_planned_for = plan, planned_for
    q_nope_lat = q_lat.transpose(1, 2).reshape(b * sq, h, rank)
    q_rope = q_pe.transpose(1, 2).reshape(b * sq, h, rope)
    out = wrapper.run(query=(q_nope_lat, q_rope), kv_cache=(ckv, kpe))  # [B*Sq, H, L]
    return out.view(b, sq, h, rank).transpose(1, 2)


# --------------------------------------------------------------------------------------------------------------
# CUDA graphs (torch.compile with a static cache, as generate() does by itself for cache_implementation="static").
#
# A captured graph replays the kernel launch without running any Python, so the kernel must find its per-step
# metadata in buffers whose addresses never change. Each graph wrapper is a FlashInfer wrapper built with
# use_cuda_graph=True over fixed metadata buffers, for one (device, backend, heads, dtype, batch, query length,
# cache pitch). The attention runs through the custom op below, which dynamo and inductor treat as opaque; the
# mask function re-plans every matching graph wrapper once per step *before* the graph replays (with a static
# cache, Transformers builds the mask in prepare_inputs_for_generation, outside the compiled region).
# --------------------------------------------------------------------------------------------------------------
class _GraphWrapper:
    def __init__(self, device, backend, num_heads, dtype, rank, rope, scale, batch, q_len, pitch):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        i32 = dict(dtype=torch.int32, device=device)
        self.shape = (batch, q_len, pitch)
        self.args = dict(num_heads=num_heads, head_dim_ckv=rank, head_dim_kpe=rope, page_size=1, causal=q_len > 1,
                         sm_scale=scale, q_data_type=dtype, kv_data_type=dtype, query_layout="split",
                         kv_cache_layout="split")
        self.device = device
        self.planned_step = None
        self.wrapper = BatchMLAPagedAttentionWrapper(
            workspace_buffer(device), use_cuda_graph=True, backend=backend,
            qo_indptr=torch.zeros(batch + 1, **i32), kv_indptr=torch.zeros(batch + 1, **i32),
            kv_indices=torch.zeros(batch * pitch, **i32), kv_len_arr=torch.zeros(batch, **i32),
        )

    def plan(self, valid: torch.Tensor, step) -> None:
        from flashinfer.mla import MLAPlanMetadata

        batch, q_len, pitch = self.shape
        self.wrapper.plan(metadata=MLAPlanMetadata.csr(*csr_metadata(valid, pitch, q_len)), **self.args)
        self.planned_step = step


_graph_wrappers: dict[tuple, _GraphWrapper] = {}
# Graphs (by their dynamo tracing context) that build the attention mask themselves: nothing plans their graph
# wrappers before a replay, so their decode must not use them (see `mask_planned_outside_graph`).
_graphs_building_masks: "weakref.WeakSet" = weakref.WeakSet()


# Both run as plain Python while dynamo traces (their results are constants of the graph).
@torch.compiler.assume_constant_result
def note_mask_built_in_graph() -> bool:
    """Called by the mask function while dynamo traces it (a user compiled the model's forward itself)."""
    context = TracingContext.try_get()
    if context is not None:
        _graphs_building_masks.add(context)
    return True


@torch.compiler.assume_constant_result
def mask_planned_outside_graph() -> bool:
    """Whether the graph being traced receives its mask from outside (as generate() does with a static cache, after
    planning it eagerly each step). Graphs that build their own mask get the reference backend instead: a replayed
    CUDA graph would otherwise run on the metadata of the step it was captured at."""
    context = TracingContext.try_get()
    outside = context is None or context not in _graphs_building_masks
    if not outside:
        _warn_graph_mask()
    return outside


@functools.lru_cache(maxsize=None)
def _warn_graph_mask() -> None:
    logging.getLogger("hf_flashinfer_mla").warning(
        "flashinfer_mla: this compiled graph builds its own attention mask, so FlashInfer cannot be planned before "
        "each CUDA-graph replay; its decode runs on the PyTorch reference backend. Use generate(..., "
        'cache_implementation="static"), which compiles the decode step and builds the mask outside the graph.'
    )


def _outside_graph_pool(device: torch.device, build):
    """Run `build` (allocations that live for the process) on a helper thread, and wait for its GPU work.

    torch.compile's CUDA-graph trees route every allocation of the calling thread to the graph's private memory
    pool during warm-up, and refuse to capture while a tensor from that pool outlives it. The graph wrapper's fixed
    buffers, the device workspace and FlashInfer's integer workspace (allocated by the first plan) live for the
    process, so they are allocated from another thread, which the pool does not see.
    """

    def run():
        torch.cuda.set_device(device)
        result = build()
        torch.cuda.synchronize(device)
        return result

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()
_current_step: dict[torch.device, object] = {}


def plan_graph_wrappers(plan: StepPlan) -> None:
    """Re-plan the graph wrappers this step's mask applies to (called by the mask function, once per step)."""
    device = plan.mask.device
    _current_step[device] = plan
    for wrapper in _graph_wrappers.values():
        if wrapper.device == device and wrapper.shape == (plan.batch_size, plan.q_len, plan.kv_len):
            wrapper.plan(plan.kv_valid(device), plan)


@torch.library.custom_op("hf_flashinfer_mla::fa_decode_graph", mutates_args=())
def fa_decode_graph(
    q_lat: torch.Tensor, q_pe: torch.Tensor, kv_latent: torch.Tensor, k_rot: torch.Tensor, mask: torch.Tensor,
    backend: str, scale: float,
) -> torch.Tensor:
    """`fa_decode` for compiled graphs: metadata in fixed buffers, planned by the mask function each step."""
    b, h, sq, rank = q_lat.shape
    rope = q_pe.shape[-1]
    device = q_lat.device
    ckv, pitch = cache_rows(kv_latent)
    kpe, _ = cache_rows(k_rot)
    key = (device, backend, h, q_lat.dtype, scale, b, sq, pitch)
    wrapper = _graph_wrappers.get(key)
    valid = mask[:, 0, -1, :]
    valid = valid if valid.dtype == torch.bool else valid > torch.finfo(valid.dtype).min / 2
    if wrapper is None:
        torch.cuda.current_stream(device).synchronize()  # `valid` is read from the helper thread's stream

        def build():
            workspace_buffer(device)
            new = _GraphWrapper(device, backend, h, q_lat.dtype, rank, rope, scale, b, sq, pitch)
            new.plan(valid, _current_step.get(device))
            return new

        wrapper = _graph_wrappers[key] = _outside_graph_pool(device, build)
    if not torch.cuda.is_current_stream_capturing():
        # Eager execution (the warm-up before capture, or a compile without CUDA graphs): plan now unless the mask
        # function already planned this wrapper for the current step. Never while capturing: planning syncs.
        step = _current_step.get(device)
        if step is None or wrapper.planned_step is not step:
            wrapper.plan(valid, step)
    q_nope_lat = q_lat.transpose(1, 2).reshape(b * sq, h, rank)
    q_rope = q_pe.transpose(1, 2).reshape(b * sq, h, rope)
    out = wrapper.wrapper.run(query=(q_nope_lat, q_rope), kv_cache=(ckv, kpe))
    return out.view(b, sq, h, rank).transpose(1, 2).contiguous()


@fa_decode_graph.register_fake
def _(q_lat, q_pe, kv_latent, k_rot, mask, backend, scale):
    return torch.empty_like(q_lat, memory_format=torch.contiguous_format)
