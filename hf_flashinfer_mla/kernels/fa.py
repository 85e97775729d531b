"""Hopper and Ampere decode: FlashInfer's fa3 (SM90) or fa2 (SM80+) MLA kernel, reading any cache layout in place.

The kernel reads the cache through a page table. With a page size of 1 the "pages" are the cache's own rows, so
any layout Transformers keeps (DynamicCache, StaticCache with its unfilled tail, this package's `MLALatentCache`)
is read in place: row ``b * pitch + j`` is token ``j`` of sequence ``b``, and each sequence's page list starts at
its first visible row, which is how left padding and the static cache's unfilled tail are skipped. Nothing is
copied, and where every sequence sees one run of rows (every mask Transformers builds) the page table is a fixed
identity whose offsets go into the plan: no step builds indices (`addressing`).

FlashInfer's public ``BatchMLAPagedAttentionWrapper.plan`` costs more host time per step than a whole decode layer
(BENCHMARKS.md, "One layer's decode kernel"): Python contract checks, a new backend object with fresh 8 MiB
workspaces per plan, and ``aminmax(kv_indices).item()``, a device sync. For the FlashInfer releases in
`TESTED_FLASHINFER` the builder instead calls the generated module directly,
as SGLang's ``fast_mla_decode_plan`` does (`GeneratedFa`): FlashInfer's own host-side validators first (the
work-item capacity and the causal tile bound: a refused plan raises `Refused`, never launches; decode steps that a
bound proves acceptable skip them, `work_items_bound`), then its native ``plan`` on host arrays (the scheduler
writes the work list to a pinned scratch, copied to the GPU asynchronously) and ``run`` with the indices on the
GPU. That surface is private, so any other release takes the public wrapper (logged once, at INFO), as does
``HF_FLASHINFER_MLA_FA_PLANNER=wrapper``.

Sparse (DSA) layers use the same kernel with every query token as its own request (`sparse_metadata`): its pages
are the rows the indexer picked, ``kv_indices[n * topk + j] = b * pitch + indices[b, s, j]``, and its length is
``min(topk, positions it sees)``, known on the host, so the schedule is planned once per step and each layer only
adds its indices to the sequences' offsets on the GPU. The public wrapper binds its indices at plan time (one plan
per layer), so sparse steps take the generated module only.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
import transformers.utils.logging  # noqa: F401  (gives logging.Logger its info_once)

from ..buffers import identity_rows, workspace_buffer
from ..rows import Rows, check_int32, to_device
from . import Refused, cache_pitch, refuse_inexpressible

logger = logging.getLogger("hf_flashinfer_mla")

# FlashInfer releases whose generated-module surface (get_batch_mla_module, the native module's plan and run,
# _validate_generated_fa_plan, _validate_fa_plan_workload) was read and is called directly. Identical in both.
TESTED_FLASHINFER = ("0.7.2.post1", "0.7.4")
PLANNER_ENV = "HF_FLASHINFER_MLA_FA_PLANNER"  # "wrapper": always use FlashInfer's public wrapper
INT_WORKSPACE_BYTES = 8 * 1024 * 1024  # FlashInfer's own size for the MLA planner's integer workspace
MAX_WORK_ITEMS = 16384  # FlashInfer's native scheduler capacity (scheduler.cuh, _FA_MAX_WORK_ITEMS)


def work_items_bound(batch: int, q_len: int, num_heads: int, sms: int) -> int:
    """At least the number of work items FlashInfer's fa2/fa3 scheduler makes for `batch` sequences of `q_len` query
    tokens: one per query tile, plus at most one KV split per cluster of SMs (every split but a sequence's last is
    the whole split limit, which is at least the average length per cluster: ``scheduler.cuh`` ``MLAPlan``,
    ``_fa_common._fa_plan_work_count``). At most `MAX_WORK_ITEMS` means FlashInfer accepts a non-causal plan at
    any cached lengths."""
    tile_q = 128 if q_len * num_heads > 64 else 64
    return batch * math.ceil(q_len * num_heads / tile_q) + sms


def refusal_for_every_step(layer, batch: int, q_len: int) -> str | None:
    """Why FlashInfer might refuse some step of this shape, whatever its cached lengths (None: it never does).

    A CUDA graph replays one backend, so a shape is captured on fa2/fa3 only when none of its steps can be refused:
    the causal tile bound refuses a step of 2-8 query tokens when a 64- or 128-row query tile ends inside a query
    token's heads (``_validate_fa_causal_tile_bound``); the scheduler holds at most `MAX_WORK_ITEMS` work items."""
    tile_q = 128 if q_len * layer.heads > 64 else 64
    if q_len > 1 and any(end % layer.heads for end in range(tile_q, q_len * layer.heads, tile_q)):
        return f"causal steps of {q_len} query tokens at {layer.heads} heads may not divide the query tile"
    sms = torch.cuda.get_device_properties(layer.device).multi_processor_count
    if work_items_bound(batch, q_len, layer.heads, sms) > MAX_WORK_ITEMS:
        return f"batch {batch} may exceed the scheduler's {MAX_WORK_ITEMS} work items"
    return None


# --------------------------------------------------------------------------------------------------------------
# Operands
# --------------------------------------------------------------------------------------------------------------
def cache_rows(latent: torch.Tensor, pitch: int | None = None) -> torch.Tensor:
    """``[B, 1, S, D]`` cache view -> ``[rows, 1, D]`` view of its storage (sequence ``b`` at rows ``b * pitch``;
    `pitch`: the layer's, else read off the view)."""
    b, _, n, d = latent.shape
    batch_stride, _, row, last = latent.stride()
    if last != 1:
        raise ValueError("the latent cache must be contiguous in its last dimension")
    if b > 1 and batch_stride % row:
        raise ValueError(f"cache batch stride {batch_stride} is not a whole number of rows of {row}")
    rows = (b - 1) * (cache_pitch(latent) if pitch is None else pitch) + n
    return latent.as_strided((rows, 1, d), (row, row, 1), latent.storage_offset())


def addressing(rows: Rows, pitch: int, device: torch.device, pages=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(page offsets [B + 1] int32 on the host, page indices int32 on `device`)`` for the generated module.

    Its kernels read sequence ``b``'s pages at ``kv_indices[kv_indptr[b] + j]`` for ``j < kv_len[b]`` (the plan
    copies ``kv_indptr[b]`` per work item; ``scheduler.cuh`` ``MLAPlan``, ``mla_hopper.cuh``/``mla.cuh``), so the
    offsets need not be compact: single-run rows point straight into the identity (`buffers.identity_rows`) and
    nothing is built per step; a paged cache's requests (`rows.PageTable`) into the step's read indices. Rows with
    holes get compact offsets and their explicit indices."""
    if pages is not None:
        return pages.indptr(), pages.typed(torch.int32)
    if rows.first is None:
        return rows.kv_indptr(), rows.kv_indices(pitch, device)
    return rows.page_offsets(pitch), identity_rows(device, rows.batch * pitch)


def upload(scratch: torch.Tensor, staged: int, int_workspace: torch.Tensor):
    """Copy a schedule staged in the pinned host `scratch` to the device `int_workspace`, asynchronously. Returns the
    event after which `scratch` may be written again (None off CUDA, where the copy is synchronous)."""
    int_workspace[:staged].copy_(scratch[:staged], non_blocking=True)
    if int_workspace.device.type != "cuda":
        return None
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(int_workspace.device))
    return copied


# --------------------------------------------------------------------------------------------------------------
# FlashInfer's generated module, or its public wrapper
# --------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def generated_surface() -> SimpleNamespace | None:
    """FlashInfer's private generated-module surface, if the installed release is one of `TESTED_FLASHINFER`."""
    import flashinfer

    if getattr(flashinfer, "__version__", None) not in TESTED_FLASHINFER:
        logger.info(
            "flashinfer_mla: FlashInfer %s is not one of %s, whose private planner surface was read; fa2/fa3 "
            "steps are planned through its public BatchMLAPagedAttentionWrapper (slower planning, same kernels).",
            getattr(flashinfer, "__version__", "?"), ", ".join(TESTED_FLASHINFER),
        )
        return None
    from flashinfer.mla._batch_mla._backends import _capabilities, _fa_common

    return SimpleNamespace(
        get_module=_fa_common.get_batch_mla_module,
        native=lambda module: module._module,  # the compiled module under FlashInfer's _BatchMLAModuleProxy
        validate_static=_fa_common._validate_generated_fa_plan,
        validate_workload=_fa_common._validate_fa_plan_workload,
        refused=_capabilities._BackendPlanUnsupportedError,
    )


def uses_generated_module() -> bool:
    return os.environ.get(PLANNER_ENV) != "wrapper" and generated_surface() is not None


class GeneratedFa:
    """FlashInfer's generated fa2/fa3 MLA module for one (device, backend, heads, dtype, dims), with the result of
    FlashInfer's checks that do not depend on the step.

    The schedule a plan writes lives in an integer workspace owned by its caller: one per step (`FaMetadata`, from
    PyTorch's caching allocator, so concurrent generate() calls in several threads never share one) or one per
    CUDA-graph slot (fixed address). The native planner writes it to a pinned host scratch, from which it is copied
    to the GPU asynchronously. FlashInfer's own proxy (``plan_with_staged_workspace_bytes``) first copies it into
    fresh pinned memory, on the host, so that the scratch is free when plan returns; this class instead keeps two
    scratches per module, used in turn, and plans into one only after the GPU has finished reading its previous
    schedule (an event per scratch, always complete in a loop that waits for each step's tokens, as generate()
    does; the host waits for it otherwise). That saves a copy of ~590 KB per plan on the host, and allocating them
    once saves milliseconds (pinned memory is slow to allocate)."""

    def __init__(self, device, backend, num_heads, dtype, rank, rope, kv_dtype=None):
        surface = generated_surface()
        self.surface, self.device, self.backend, self.num_heads, self.dtype = surface, device, backend, num_heads, dtype
        self.kv_dtype, self.rank = kv_dtype or dtype, rank  # kv float8_e4m3fn: the FP8 latent, read in place
        self.float_workspace = workspace_buffer(device)
        self._scratches: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []  # (scratch, its last copy)
        self._turn = 0
        self._scratch_lock = threading.Lock()
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
        self.refused = self._static_refusal(rope)
        self.module = None if self.refused else surface.get_module(
            backend, dtype, self.kv_dtype, dtype, torch.int32, rank, rope, False)

    def _static_refusal(self, rope) -> str | None:
        """FlashInfer's checks that do not depend on the step (dtypes, dims, shared memory, workspace size)."""
        i32 = functools.partial(torch.zeros, dtype=torch.int32)
        try:
            self.surface.validate_static(
                backend=self.backend, device=self.device, qo_indptr=i32(2), kv_indptr=i32(2), kv_indices=i32(0),
                kv_len_arr=i32(1), head_dim_ckv=self.rank, head_dim_kpe=rope, q_data_type=self.dtype,
                kv_data_type=self.kv_dtype, output_dtype=self.dtype, scale_mode=scale_mode(self.kv_dtype),
            )
        except self.surface.refused as exc:
            return str(exc)
        if self.sms is not None:  # partial outputs of the split KV chunks (FlashInfer 0.7.4's preflight)
            need = 2 * self.sms * 64 * (2 * self.rank + 4) + 16
            if self.float_workspace.numel() < need:
                return f"the float workspace holds {self.float_workspace.numel()} bytes, {need} are needed"
        return None

    def new_workspace(self) -> torch.Tensor:
        return torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)

    def schedule(self, rows: Rows, kv_indptr: torch.Tensor, causal: bool, int_workspace: torch.Tensor,
                 scratch: torch.Tensor) -> tuple[list, int]:
        """FlashInfer's workload validation, then its native scheduler on the host arrays (`kv_indptr`: the page
        offsets of `addressing`). The schedule of `int_workspace` is written to the pinned host `scratch`
        only: nothing reaches the GPU (`upload` does that). Returns ``(plan info, bytes staged in scratch)``.

        A non-causal step within the scheduler's work-item capacity (`work_items_bound`) is accepted at any cached
        lengths, so FlashInfer's Python validator, which walks every sequence, is skipped for it."""
        if self.refused:
            raise Refused(self.refused)
        proven = (not causal and self.sms is not None
                  and work_items_bound(rows.batch, rows.q_len, self.num_heads, self.sms) <= MAX_WORK_ITEMS)
        if not proven:
            try:
                self.surface.validate_workload(rows.qo_indptr(), rows.lens, self.num_heads, causal, self.device,
                                               self.backend, self.kv_dtype)
            except self.surface.refused as exc:
                raise Refused(str(exc)) from None
        plan_info, staged = self.surface.native(self.module).plan(
            self.float_workspace, int_workspace, scratch, rows.qo_indptr(), kv_indptr, rows.lens, self.num_heads,
            self.rank, causal)
        staged = int(staged)
        if not 0 <= staged <= min(scratch.numel(), int_workspace.numel()):
            raise RuntimeError(f"FlashInfer's MLA planner staged {staged} bytes, more than its workspaces hold")
        return plan_info, staged

    def plan(self, rows: Rows, kv_indptr: torch.Tensor, causal: bool, int_workspace: torch.Tensor):
        """`schedule` into this module's host scratch whose turn it is, then `upload` to `int_workspace`. Returns
        the plan info the kernel launch needs."""
        with self._scratch_lock:
            turn = self._next_scratch()
            scratch = self._scratches[turn][0]
            plan_info, staged = self.schedule(rows, kv_indptr, causal, int_workspace, scratch)
            self._scratches[turn] = (scratch, upload(scratch, staged, int_workspace))
        return plan_info

    def _next_scratch(self) -> int:
        """Index of the host scratch whose turn it is, once the GPU has read what it held (under the lock)."""
        turn, self._turn = self._turn, 1 - self._turn
        if len(self._scratches) <= turn:  # allocated on first use
            pinned = self.device.type == "cuda"
            self._scratches.append((torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=pinned), None))
        copied = self._scratches[turn][1]
        if copied is not None and not copied.query():
            copied.synchronize()  # a plan two steps ahead of the GPU: wait for the copy of two plans ago
        return turn

    def run(self, plan_info, int_workspace, q_nope, q_rope, ckv, kpe, kv_indices, out, causal: bool, scale: float,
            kv_scales=(1.0, 1.0)) -> None:
        self.module.run(
            self.float_workspace, int_workspace, plan_info, q_nope, q_rope, ckv, kpe, kv_indices, out, None,
            1 if causal else 0,  # flashinfer.utils.MaskMode CAUSAL / NON_CAUSAL
            self.num_heads, 1, scale,  # heads, page size, softmax scale
            False, float(kv_scales[0]), float(kv_scales[1]), None,  # return_lse_base_on_e, ckv/kpe scales, no array
        )


# A documented cache: the generated module and its pinned scratches of each (device, backend, heads, dtypes, dims),
# for the process (compiling or loading a module and pinning host memory are slow). It holds no per-step state.
_engines: dict[tuple, GeneratedFa] = {}


def generated_fa(layer, backend: str) -> GeneratedFa:
    key = (layer.device, backend, layer.heads, layer.dtype, layer.rank, layer.rope, layer.kv_dtype)
    if key not in _engines:
        _engines[key] = GeneratedFa(layer.device, backend, layer.heads, layer.dtype, layer.rank, layer.rope,
                                    kv_dtype=layer.kv_dtype)
    return _engines[key]


def reset() -> None:
    """Drop the generated modules and their scratches (see `hf_flashinfer_mla.reset`)."""
    _engines.clear()


def scale_mode(kv_dtype: torch.dtype) -> str:
    """FlashInfer's scale mode for a KV dtype: per-tensor dequantization scales for an FP8 cache."""
    return "kv-per-tensor" if kv_dtype == torch.float8_e4m3fn else "default"


def wrapper_plan(wrapper, rows: Rows, kv_indices, causal: bool, layer) -> None:
    """Plan FlashInfer's public wrapper (any release): `Refused` if it declines the workload."""
    from flashinfer.mla import MLAPlanMetadata

    try:
        wrapper.plan(
            metadata=MLAPlanMetadata.csr(rows.qo_indptr(), rows.kv_indptr(), kv_indices, rows.lens),
            num_heads=layer.heads, head_dim_ckv=layer.rank, head_dim_kpe=layer.rope, page_size=1, causal=causal,
            sm_scale=layer.scale, q_data_type=layer.dtype, kv_data_type=layer.kv_dtype, query_layout="split",
            kv_cache_layout="split", **({"scale_mode": "kv-per-tensor"} if layer.kv_dtype != layer.dtype else {}),
        )
    except ValueError as exc:
        if type(exc).__name__ == "_BackendPlanUnsupportedError":
            raise Refused(str(exc)) from None
        raise


# --------------------------------------------------------------------------------------------------------------
# Builder and kernel
# --------------------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class FaMetadata:
    """One step's fa2/fa3 metadata for caches of one row pitch: the schedule in `int_workspace` (its plan info for
    the launch) and the page indices, or FlashInfer's planned public wrapper. A CUDA-graph slot keeps one whose
    buffers never move (`fixed`) and rebuilds it in place every step."""

    backend: str
    causal: bool
    engine: GeneratedFa | None
    int_workspace: torch.Tensor | None = None
    plan_info: list | None = None
    kv_indices: torch.Tensor | None = None
    wrapper: object = None
    fixed: bool = False
    layout: tuple | None = None  # a fixed slot's schedule layout, as a tuple (reading FlashInfer's array is slow)
    staging: torch.Tensor | None = None  # a fixed slot's own pinned scratch for schedules planned ahead
    staging_read: object = None  # event: the GPU has copied the staging scratch's last schedule
    identity: bool = True  # a fixed slot's kv_indices hold the identity
    sparse_base: torch.Tensor | None = None  # sparse layers: [B * Sq, 1] int32 offset of each query token's sequence


@dataclass(eq=False)
class Staged:
    """A fixed slot's next schedule, computed on the host ahead of its step (`ahead`), uploaded by `build`."""

    plan_info: list
    layout: tuple
    nbytes: int


def build(backend: str, step, layer, into: FaMetadata | None = None, staged: Staged | None = None) -> FaMetadata:
    """This step's metadata for `layer`, or `Refused`. With `into` (a CUDA-graph slot's fixed metadata) the schedule
    and indices are written into its buffers, stream-ordered, and the slot is returned."""
    causal = step.q_len > 1
    if layer.sinks:
        raise Refused("FlashInfer's MLA decode kernels take no attention sinks")
    refuse_inexpressible(step.rows())
    if layer.topk:
        if not uses_generated_module() or (into is not None and into.engine is None):
            raise Refused("sparse decode runs on FlashInfer's generated MLA module only, on a release in "
                          f"{', '.join(TESTED_FLASHINFER)}")
        if into is not None:
            return _rebuild_fixed(into, step, layer, staged)
        return sparse_metadata(backend, step.rows(), layer)
    if into is not None:
        return _rebuild_fixed(into, step, layer, staged)
    rows, pages = step.rows(), step.pages
    if uses_generated_module():
        engine = generated_fa(layer, backend)
        kv_indptr, kv_indices = addressing(rows, layer.pitch, layer.device, pages)
        workspace = engine.new_workspace()
        plan_info = engine.plan(rows, kv_indptr, causal, workspace)
        return FaMetadata(backend, causal, engine, workspace, plan_info, kv_indices)
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    wrapper = BatchMLAPagedAttentionWrapper(workspace_buffer(layer.device), backend=backend)
    indices = (rows.kv_indices(layer.pitch, layer.device) if pages is None
               else pages.gather(rows.lens, layer.device, compact=True))
    wrapper_plan(wrapper, rows, indices, causal, layer)
    return FaMetadata(backend, causal, None, wrapper=wrapper)


def sparse_metadata(backend: str, rows: Rows, layer) -> FaMetadata:
    """A sparse step's metadata: the schedule of its query tokens as requests of one token over ``min(topk,
    visible)`` pages each (page offsets ``n * topk``, not compact: the kernels take any offsets, see `addressing`),
    and each token's sequence offset on the device, to which every layer adds its own indices."""
    engine = generated_fa(layer, backend)
    tokens = rows.token_rows(layer.topk)
    check_int32(rows.batch * layer.pitch, rows.batch, layer.pitch)
    offsets = torch.arange(tokens.batch + 1, dtype=torch.int32) * layer.topk
    workspace = engine.new_workspace()
    plan_info = engine.plan(tokens, offsets, False, workspace)
    base = (torch.arange(rows.batch, dtype=torch.int32) * layer.pitch).repeat_interleave(rows.q_len)
    return FaMetadata(backend, False, engine, workspace, plan_info, sparse_base=to_device(base[:, None], layer.device))


def fixed(backend: str, layer, batch: int, q_len: int) -> FaMetadata:
    """Empty fixed-address metadata for a CUDA-graph slot of this shape (see `graphs.py` for where it is allocated).
    A sparse layer's slot holds the schedule of its query tokens and each token's sequence offset; its page indices
    are the selection the replayed forward computes."""
    if layer.topk:
        if not uses_generated_module():
            raise Refused("sparse decode runs on FlashInfer's generated MLA module only")
        engine = generated_fa(layer, backend)
        base = (torch.arange(batch, dtype=torch.int32) * layer.pitch).repeat_interleave(q_len)[:, None]
        return FaMetadata(backend, False, engine, engine.new_workspace(), fixed=True,
                          sparse_base=base.to(layer.device))
    kv_indices = torch.arange(batch * layer.pitch, dtype=torch.int32, device=layer.device)
    if uses_generated_module():
        engine = generated_fa(layer, backend)
        return FaMetadata(backend, q_len > 1, engine, engine.new_workspace(), kv_indices=kv_indices, fixed=True)
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    i32 = dict(dtype=torch.int32, device=layer.device)
    wrapper = BatchMLAPagedAttentionWrapper(
        workspace_buffer(layer.device), use_cuda_graph=True, backend=backend, qo_indptr=torch.zeros(batch + 1, **i32),
        kv_indptr=torch.zeros(batch + 1, **i32), kv_indices=kv_indices, kv_len_arr=torch.zeros(batch, **i32),
    )
    return FaMetadata(backend, q_len > 1, None, kv_indices=kv_indices, wrapper=wrapper, fixed=True)


def _rebuild_fixed(meta: FaMetadata, step, layer, staged: Staged | None) -> FaMetadata:
    rows, pages = step.rows(), step.pages
    try:
        if pages is not None and meta.engine is None:
            raise Refused("continuous batching's steps in CUDA graphs run on FlashInfer's generated module only")
        if meta.engine is None:
            indices = rows.kv_indices(layer.pitch, layer.device)
            wrapper_plan(meta.wrapper, rows, indices, meta.causal, layer)
            _set_indices(meta, indices)
            return meta
        if staged is not None:
            meta.staging_read = upload(meta.staging, staged.nbytes, meta.int_workspace)
            plan_info, layout = staged.plan_info, staged.layout
        elif layer.topk:  # every query token a request of its own, over min(topk, visible) selected rows
            tokens = rows.token_rows(layer.topk)
            offsets = torch.arange(tokens.batch + 1, dtype=torch.int32) * layer.topk
            plan_info = meta.engine.plan(tokens, offsets, False, meta.int_workspace)
            layout = tuple(plan_info)
        else:
            # (not `addressing`: its identity lives for the process, and this may run during CUDA-graph warm-up,
            # whose allocations belong to the graph's pool; the slot's own indices are the identity)
            offsets = rows.page_offsets(layer.pitch) if pages is None else pages.indptr()
            plan_info = meta.engine.plan(rows, offsets, meta.causal, meta.int_workspace)
            layout = tuple(plan_info)
    except Refused as exc:
        # The slot's shape was admitted by `refusal_for_every_step`; a refusal means FlashInfer changed its rules.
        raise RuntimeError(f"FlashInfer refused a CUDA-graph decode plan it was expected to accept: {exc}. "
                           "Run without CUDA graphs (generate(..., disable_compile=True)).") from None
    if pages is None and not layer.topk:  # (a paged step's indices are its rows, which its route passes on)
        _set_indices(meta, None if rows.first is not None else rows.kv_indices(layer.pitch, layer.device))
    if meta.layout is None:
        meta.plan_info, meta.layout = plan_info, layout
    elif layout != meta.layout:
        # The captured launch holds the schedule's offsets and grid, fixed for a fixed batch and query shape.
        raise RuntimeError("FlashInfer's MLA schedule layout changed between steps of one CUDA-graph shape")
    return meta


def replayed(meta: FaMetadata, pages) -> FaMetadata:
    """A continuous-batching slot's metadata in its graph: its schedule, the whole padded read indices as pages."""
    return replace(meta, kv_indices=pages.typed(torch.int32))


def _set_indices(meta: FaMetadata, indices: torch.Tensor | None) -> None:
    """Explicit page indices into the fixed buffer, or (None) the identity back where explicit ones were."""
    if indices is not None:
        meta.kv_indices[: indices.numel()].copy_(indices)
        meta.identity = False
    elif not meta.identity:
        meta.kv_indices.copy_(torch.arange(meta.kv_indices.numel(), dtype=torch.int32, device=meta.kv_indices.device))
        meta.identity = True


def ahead(meta: FaMetadata, rows: Rows, layer):
    """The next step's metadata for its predicted `rows`, planned now, while the GPU runs this step (``plan.py``'s
    `plan_next`): a full `FaMetadata` for an eager step; for a fixed slot, whose workspace the replay in flight
    still reads, only a host-side `Staged` schedule in the slot's own scratch. None where nothing can be planned
    ahead (FlashInfer's wrapper binds its buffers at plan time; a cache that must grow)."""
    if meta.engine is None or (rows.end or 0) > layer.pitch:
        return None
    try:
        if layer.topk:
            return sparse_metadata(meta.backend, rows, layer)
        if not meta.fixed:
            kv_indptr, kv_indices = addressing(rows, layer.pitch, layer.device)
            workspace = meta.engine.new_workspace()
            plan_info = meta.engine.plan(rows, kv_indptr, meta.causal, workspace)
            return FaMetadata(meta.backend, meta.causal, meta.engine, workspace, plan_info, kv_indices)
        if meta.staging is None:
            meta.staging = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=layer.device.type == "cuda")
        elif meta.staging_read is not None:
            meta.staging_read.synchronize()  # its last upload, queued before this step's replay: done once the
            # GPU has finished the step before, which generate() waits for too (a step late or not)
        plan_info, nbytes = meta.engine.schedule(rows, rows.page_offsets(layer.pitch), meta.causal,
                                                 meta.int_workspace, meta.staging)
    except Refused:
        return None  # the next step plans (and reports) it itself
    return Staged(plan_info, tuple(plan_info), nbytes)


def run(meta: FaMetadata, layer, q_lat, q_pe, kv_latent, k_rot, kv_scales=None, indices=None) -> torch.Tensor:
    """The kernel call (``kernels/__init__.py`` gives the operands' layouts). `kv_scales`: the (latent, rope)
    dequantization scales of an FP8 cache, read in place; `indices`: a sparse layer's selection."""
    ckv, kpe = cache_rows(kv_latent, layer.pitch), cache_rows(k_rot, layer.pitch)
    out = torch.empty_like(q_lat)
    q_nope, o = q_lat.transpose(0, 1), out.transpose(0, 1)  # [N, H, L] views: the kernels take their strides
    kv_indices = meta.kv_indices
    if layer.topk:
        kv_indices = (indices.reshape(-1, layer.topk) + meta.sparse_base).view(-1)
    if meta.engine is not None:
        meta.engine.run(meta.plan_info, meta.int_workspace, q_nope, q_pe, ckv, kpe, kv_indices, o,
                        meta.causal, layer.scale, kv_scales or (1.0, 1.0))
    else:
        # (the public wrapper's contract checks are not read for strided operands: hand it contiguous ones)
        fp8 = {} if kv_scales is None else {"ckv_scale": float(kv_scales[0]), "kpe_scale": float(kv_scales[1])}
        o.copy_(meta.wrapper.run(query=(q_nope.contiguous(), q_pe.contiguous()), kv_cache=(ckv, kpe), **fp8))
    return out
