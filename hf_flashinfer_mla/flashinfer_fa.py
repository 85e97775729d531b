"""Hopper and Ampere decode: FlashInfer's fa3 (SM90) or fa2 (SM80+) MLA kernel, reading any cache layout in place.

The kernel reads the cache through a page table. With a page size of 1 the "pages" are the cache's own rows, so
any layout Transformers keeps (DynamicCache, StaticCache with its unfilled tail, this package's `MLALatentCache`)
is read in place: row ``b * pitch + j`` is token ``j`` of sequence ``b``, and each sequence's page list starts at
its first visible row, which is how left padding and the static cache's unfilled tail are skipped. Nothing is
copied, and where every sequence sees one run of rows (every mask Transformers builds) the page table is a fixed
identity whose offsets go into the plan: no step builds indices (`PagedRows.addressing`).

Planning happens once per step and device, and is kept in the step's `StepPlan` (`fa_step`): the per-row lengths
on the host (`PagedRows`: from the step's host-known ranges without any device sync, or read off the mask with
one) and the kernel's work schedule. Inside ``generate()`` a step is planned while the GPU runs the previous one
(`FaStep.ahead`, called by `StepPlan.plan_next`); otherwise its first layer plans it.

FlashInfer's public ``BatchMLAPagedAttentionWrapper.plan`` costs about 1.6 ms per step on 0.7.4: Python contract
checks, a new backend object with fresh 8 MiB workspaces per plan, and ``aminmax(kv_indices).item()``, a device
sync. For the FlashInfer releases in `TESTED_FLASHINFER` this module instead calls the generated module directly,
as SGLang's ``fast_mla_decode_plan`` does (`GeneratedFa`): FlashInfer's own host-side validators first (the
work-item capacity and the causal tile bound: a refused plan is reported, never launched; decode steps that a
bound proves acceptable skip them, `work_items_bound`), then
its native ``plan`` on host arrays (the scheduler writes the work list to a pinned scratch, copied to the GPU
asynchronously) and ``run`` with the indices on the GPU. That surface is private, so any other release takes the
public wrapper (`wrapper_plan`), as does ``HF_FLASHINFER_MLA_FA_PLANNER=wrapper``.

A plan FlashInfer refuses (causal steps of 2-8 query tokens at head counts that do not divide its query tile)
runs the step on fa2 if fa2 accepts it, else on the reference backend, after one warning (`fa_backend_for_step`).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import transformers.utils.logging  # noqa: F401  (gives logging.Logger its warning_once)

from .buffers import identity_rows, workspace_buffer
from .dispatch import unavailable_reason

logger = logging.getLogger("hf_flashinfer_mla")

# FlashInfer releases whose generated-module surface (get_batch_mla_module, the native module's plan and run,
# _validate_generated_fa_plan, _validate_fa_plan_workload) was read and is called directly. Identical in both.
TESTED_FLASHINFER = ("0.7.2.post1", "0.7.4")
PLANNER_ENV = "HF_FLASHINFER_MLA_FA_PLANNER"  # "wrapper": always use FlashInfer's public wrapper
INT_WORKSPACE_BYTES = 8 * 1024 * 1024  # FlashInfer's own size for the MLA planner's integer workspace
MAX_WORK_ITEMS = 16384  # FlashInfer's native scheduler capacity (scheduler.cuh, _FA_MAX_WORK_ITEMS)


class PlanRefused(Exception):
    """FlashInfer declined to plan this step (its validators found the workload unsupported)."""


def work_items_bound(batch: int, q_len: int, num_heads: int, sms: int) -> int:
    """At least the number of work items FlashInfer's fa2/fa3 scheduler makes for `batch` sequences of `q_len` query
    tokens: one per query tile, plus at most one KV split per cluster of SMs (every split but a sequence's last is
    the whole split limit, which is at least the average length per cluster: ``scheduler.cuh`` ``MLAPlan``,
    ``_fa_common._fa_plan_work_count``). At most `MAX_WORK_ITEMS` means FlashInfer accepts a non-causal plan at
    any cached lengths."""
    tile_q = 128 if q_len * num_heads > 64 else 64
    return batch * math.ceil(q_len * num_heads / tile_q) + sms


# --------------------------------------------------------------------------------------------------------------
# Layout helpers shared by the eager and the CUDA-graph entry points
# --------------------------------------------------------------------------------------------------------------
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


def kernel_inputs(q_lat, q_pe, kv_latent, k_rot):
    """The kernel's operands: queries ``[B * Sq, H, L]`` / ``[B * Sq, H, R]`` and the two caches as rows."""
    b, h, sq, rank = q_lat.shape
    ckv, pitch = cache_rows(kv_latent)
    kpe, kpe_pitch = cache_rows(k_rot)
    if kpe_pitch != pitch:
        raise ValueError(f"latent and rope caches disagree on the row pitch ({pitch} vs {kpe_pitch})")
    q_nope = q_lat.transpose(1, 2).reshape(b * sq, h, rank)
    q_rope = q_pe.transpose(1, 2).reshape(b * sq, h, q_pe.shape[-1])
    return q_nope, q_rope, ckv, kpe, pitch


def latent_output(out: torch.Tensor, batch: int) -> torch.Tensor:
    """The kernel's ``[B * Sq, H, L]`` output as ``[B, H, Sq, L]``."""
    n, h, rank = out.shape
    return out.view(batch, n // batch, h, rank).transpose(1, 2)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to `device` without blocking the host (through pinned memory on CUDA)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


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
# Paged rows: the page-size-1 CSR metadata of a step
# --------------------------------------------------------------------------------------------------------------
@dataclass
class PagedRows:
    """Which cache rows each sequence attends to. The planner reads host arrays; the kernel reads page indices on
    the device (`addressing`)."""

    qo_indptr: torch.Tensor  # [B + 1] int32, host
    kv_indptr: torch.Tensor  # [B + 1] int32, host: the compact CSR offsets of `kv_indices`
    kv_len: torch.Tensor  # [B] int32, host
    first: torch.Tensor | None  # [B] int64, host: each row is the single run [first, first + len)
    positions: tuple[torch.Tensor, torch.Tensor] | None = None  # (row, position) on the device, when not runs

    @property
    def total(self) -> int:
        return int(self.kv_indptr[-1])

    def addressing(self, pitch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv_indptr [B + 1] int32 on the host, kv_indices int32 on `device`)`` for FlashInfer's generated module.

        Its kernels read sequence ``b``'s pages at ``kv_indices[kv_indptr[b] + j]`` for ``j < kv_len[b]`` (the
        plan copies ``kv_indptr[b]`` per work item; ``scheduler.cuh`` ``MLAPlan``, ``mla_hopper.cuh``/``mla.cuh``),
        so the offsets need not be compact. Rows that are single runs point straight into the identity
        (`page_offsets`, over `buffers.identity_rows`): nothing is built per step. Other rows get compact CSR
        offsets and their explicit indices."""
        if self.first is None:
            return self.kv_indptr, self.kv_indices(pitch, device)
        return self.page_offsets(pitch), identity_rows(device, self.kv_len.numel() * pitch)

    def page_offsets(self, pitch: int) -> torch.Tensor:
        """``[B + 1]`` int32 host offsets of each sequence's pages: ``b * pitch + first[b]`` into an identity page
        table for single-run rows, the compact CSR offsets otherwise."""
        if self.first is None:
            return self.kv_indptr
        batch = self.kv_len.numel()
        _check_int32(batch * pitch, batch, pitch)
        kv_indptr = torch.empty(batch + 1, dtype=torch.int32)
        kv_indptr[:-1] = torch.arange(batch, dtype=torch.long) * pitch + self.first
        kv_indptr[-1] = batch * pitch
        return kv_indptr

    def kv_indices(self, pitch: int, device: torch.device) -> torch.Tensor:
        """``[total]`` int32 row indices on `device`, in the compact CSR order of `kv_indptr` (device arithmetic on
        a copy of ``B`` host values: no sync). FlashInfer's public wrapper takes these."""
        if self.first is None:
            row, pos = self.positions
            return (row * pitch + pos).to(torch.int32)
        batch = self.kv_len.numel()
        starts = torch.arange(batch, dtype=torch.long) * pitch + self.first
        if batch:
            _check_int32(int((starts + self.kv_len).max()), batch, pitch)
        host = torch.stack([starts - self.kv_indptr[:-1], self.kv_len.long()]).to(torch.int32)
        offsets, lens = _to_device(host, device)
        total = self.total
        steps = torch.arange(total, dtype=torch.int32, device=device)
        return steps + torch.repeat_interleave(offsets, lens, output_size=total)


def _check_int32(rows: int, batch: int, pitch: int) -> None:
    if rows >= 2**31:
        raise ValueError(f"a cache of {batch} x {pitch} rows exceeds FlashInfer's int32 page indices")


def _csr(lens: torch.Tensor, q_len: int):
    kv_indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    kv_indptr[1:] = lens.cumsum(0)
    qo_indptr = torch.arange(lens.numel() + 1, dtype=torch.int32) * q_len
    return qo_indptr, kv_indptr


def rows_from_ranges(ranges, q_len: int) -> PagedRows:
    """`PagedRows` of host-known `KVRanges` (no device work)."""
    lens = ranges.lengths().to(torch.int32)
    qo_indptr, kv_indptr = _csr(lens, q_len)
    return PagedRows(qo_indptr, kv_indptr, lens, ranges.first)


def rows_from_mask(valid: torch.Tensor, q_len: int) -> PagedRows:
    """`PagedRows` of the positions marked in ``valid [B, S]``, at the cost of one device-to-host copy of ``B``
    values. Rows whose valid positions form one run (left padding, a static cache's unfilled tail: every mask
    Transformers builds) are indexed arithmetically; any other pattern goes through ``nonzero`` (a second sync)."""
    s = valid.shape[-1]
    lens = valid.sum(-1, dtype=torch.int32)
    first = valid.int().argmax(-1)  # 0 for an empty row, whose length is 0 anyway
    last = s - 1 - valid.flip(-1).int().argmax(-1)
    one_run = (lens == 0) | (last - first + 1 == lens)
    host = torch.stack([lens, first.int(), one_run.int()]).cpu()  # the sync
    lens_host = host[0].clone()
    qo_indptr, kv_indptr = _csr(lens_host, q_len)
    if bool(host[2].all()):
        return PagedRows(qo_indptr, kv_indptr, lens_host, host[1].long())
    return PagedRows(qo_indptr, kv_indptr, lens_host, None, valid.nonzero(as_tuple=True))


def csr_metadata(valid: torch.Tensor, pitch: int, q_len: int):
    """``(qo_indptr, kv_indptr, kv_indices, kv_len)`` of ``valid [B, S]``: host arrays, indices on its device."""
    rows = rows_from_mask(valid, q_len)
    return rows.qo_indptr, rows.kv_indptr, rows.kv_indices(pitch, valid.device), rows.kv_len


def paged_rows(plan, device: torch.device) -> PagedRows:
    """The step's `PagedRows` for `device`, built once per step and device."""

    def build():
        if plan.ranges is not None:
            return rows_from_ranges(plan.ranges, plan.q_len)
        return rows_from_mask(plan.kv_valid(device), plan.q_len)

    return plan.state(("rows", device), build)


# --------------------------------------------------------------------------------------------------------------
# The two ways to plan and run: FlashInfer's generated module directly, or its public wrapper
# --------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def generated_surface() -> SimpleNamespace | None:
    """FlashInfer's private generated-module surface, if the installed release is one of `TESTED_FLASHINFER`."""
    import flashinfer

    if getattr(flashinfer, "__version__", None) not in TESTED_FLASHINFER:
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

    The schedule a plan writes lives in an integer workspace owned by its caller: one per step (`FaStep`, from
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
        self.kv_dtype = kv_dtype or dtype  # float8_e4m3fn: the FP8 latent cache, read in place with its scales
        self.rank = rank
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

    def schedule(self, rows: PagedRows, kv_indptr: torch.Tensor, causal: bool, int_workspace: torch.Tensor,
                 scratch: torch.Tensor) -> tuple[list, int]:
        """FlashInfer's workload validation, then its native scheduler on the host arrays (`kv_indptr`: the page
        offsets of `PagedRows.addressing`). The schedule of `int_workspace` is written to the pinned host `scratch`
        only: nothing reaches the GPU (`upload` does that). Returns ``(plan info, bytes staged in scratch)``.

        A non-causal step within the scheduler's work-item capacity (`work_items_bound`) is accepted at any cached
        lengths, so FlashInfer's Python validator, which walks every sequence, is skipped for it."""
        if self.refused:
            raise PlanRefused(self.refused)
        batch = rows.kv_len.numel()
        proven = (not causal and self.sms is not None
                  and work_items_bound(batch, int(rows.qo_indptr[-1]) // max(batch, 1), self.num_heads, self.sms)
                  <= MAX_WORK_ITEMS)
        if not proven:
            try:
                self.surface.validate_workload(rows.qo_indptr, rows.kv_len, self.num_heads, causal, self.device,
                                               self.backend, self.kv_dtype)
            except self.surface.refused as exc:
                raise PlanRefused(str(exc)) from None
        plan_info, staged = self.surface.native(self.module).plan(
            self.float_workspace, int_workspace, scratch, rows.qo_indptr, kv_indptr, rows.kv_len,
            self.num_heads, self.rank, causal,
        )
        staged = int(staged)
        if not 0 <= staged <= min(scratch.numel(), int_workspace.numel()):
            raise RuntimeError(f"FlashInfer's MLA planner staged {staged} bytes, more than its workspaces hold")
        return plan_info, staged

    def plan(self, rows: PagedRows, kv_indptr: torch.Tensor, causal: bool, int_workspace: torch.Tensor):
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

    def run(self, plan_info, int_workspace, q_nope, q_rope, ckv, kpe, kv_indices, causal: bool, scale: float,
            kv_scales=(1.0, 1.0)):
        out = torch.empty_like(q_nope)
        self.module.run(
            self.float_workspace, int_workspace, plan_info, q_nope, q_rope, ckv, kpe, kv_indices, out, None,
            1 if causal else 0,  # flashinfer.utils.MaskMode CAUSAL / NON_CAUSAL
            self.num_heads, 1, scale,  # heads, page size, softmax scale
            False, float(kv_scales[0]), float(kv_scales[1]), None,  # return_lse_base_on_e, ckv/kpe scales, no array
        )
        return out


_engines: dict[tuple, GeneratedFa] = {}


def generated_fa(device, backend, num_heads, dtype, rank, rope, kv_dtype=None) -> GeneratedFa:
    """The process-wide eager-mode module and workspaces of this device, backend, head count and dtypes."""
    key = (device, backend, num_heads, dtype, rank, rope, kv_dtype or dtype)
    if key not in _engines:
        _engines[key] = GeneratedFa(device, backend, num_heads, dtype, rank, rope, kv_dtype=kv_dtype)
    return _engines[key]


def scale_mode(kv_dtype: torch.dtype) -> str:
    """FlashInfer's scale mode for a KV dtype: per-tensor dequantization scales for an FP8 cache."""
    return "kv-per-tensor" if kv_dtype == torch.float8_e4m3fn else "default"


def _is_refusal(exc: BaseException) -> bool:
    return type(exc).__name__ == "_BackendPlanUnsupportedError"


def wrapper_plan(wrapper, rows: PagedRows, kv_indices, causal, scale, num_heads, dtype, rank, rope, kv_dtype=None):
    """Plan FlashInfer's public wrapper (any release): `PlanRefused` if it declines the workload."""
    from flashinfer.mla import MLAPlanMetadata

    kv_dtype = kv_dtype or dtype
    try:
        wrapper.plan(
            metadata=MLAPlanMetadata.csr(rows.qo_indptr, rows.kv_indptr, kv_indices, rows.kv_len),
            num_heads=num_heads, head_dim_ckv=rank, head_dim_kpe=rope, page_size=1, causal=causal, sm_scale=scale,
            q_data_type=dtype, kv_data_type=kv_dtype, query_layout="split", kv_cache_layout="split",
            **({"scale_mode": "kv-per-tensor"} if kv_dtype != dtype else {}),
        )
    except ValueError as exc:
        if _is_refusal(exc):
            raise PlanRefused(str(exc)) from None
        raise


# --------------------------------------------------------------------------------------------------------------
# One step on one device
# --------------------------------------------------------------------------------------------------------------
class FaStep:
    """The fa2/fa3 metadata of one step on one device, shared by all its layers: the rows, and per cache pitch the
    planned schedule and page indices (or FlashInfer's refusal). Every layer's cache has the same pitch in
    practice, so a step plans once."""

    def __init__(self, rows: PagedRows, causal: bool, device, backend, num_heads, dtype, rank, rope, pitches, scale,
                 kv_dtype=None):
        self.device, self.backend, self.num_heads, self.dtype, self.rank, self.rope = (
            device, backend, num_heads, dtype, rank, rope)
        self.kv_dtype = kv_dtype or dtype
        self.rows, self.causal = rows, causal
        self.refused: str | None = None
        self._schedules: dict[int, tuple] = {}
        self._wrappers: dict[tuple, object] = {}
        self.engine = (generated_fa(device, backend, num_heads, dtype, rank, rope, self.kv_dtype)
                       if uses_generated_module() else None)
        try:  # the first layer's plan tells whether FlashInfer accepts the step (its checks ignore the pitch)
            for pitch in pitches:
                if self.engine is not None:
                    self.schedule(pitch)
                else:
                    self._wrapper(pitch, scale)
        except PlanRefused as exc:
            self.refused = str(exc)

    def ahead(self, ranges, q_len: int) -> FaStep | None:
        """The same metadata for the next step's predicted rows (`metadata.StepPlan.plan_next`), planned now, at the
        pitches this step used: the schedule is computed and its upload queued while the GPU still runs this step.
        Only for the generated module (FlashInfer's wrapper binds its buffers at plan time)."""
        pitches = tuple(p for p in self._schedules if ranges.end <= p)  # a cache that must grow plans anew
        if self.engine is None or not pitches:
            return None
        return FaStep(rows_from_ranges(ranges, q_len), q_len > 1, self.device, self.backend, self.num_heads,
                      self.dtype, self.rank, self.rope, pitches, None, self.kv_dtype)

    def schedule(self, pitch: int) -> tuple:
        """``(int workspace, plan info, page indices)`` of the generated module for caches of this row pitch: the
        plan carries each sequence's page offset (`PagedRows.addressing`), so it is made per pitch."""
        if pitch not in self._schedules:
            kv_indptr, kv_indices = self.rows.addressing(pitch, self.device)
            int_workspace = self.engine.new_workspace()
            plan_info = self.engine.plan(self.rows, kv_indptr, self.causal, int_workspace)
            self._schedules[pitch] = (int_workspace, plan_info, kv_indices)
        return self._schedules[pitch]

    def _wrapper(self, pitch, scale):
        # The public wrapper binds the indices and the scale at plan time: one planned wrapper per (pitch, scale),
        # owned by this step. It gets compact CSR indices, as its contract asks.
        if (pitch, scale) not in self._wrappers:
            from flashinfer.mla import BatchMLAPagedAttentionWrapper

            wrapper = BatchMLAPagedAttentionWrapper(workspace_buffer(self.device), backend=self.backend)
            wrapper_plan(wrapper, self.rows, self.rows.kv_indices(pitch, self.device), self.causal, scale,
                         self.num_heads, self.dtype, self.rank, self.rope, self.kv_dtype)
            self._wrappers[(pitch, scale)] = wrapper
        return self._wrappers[(pitch, scale)]

    def run(self, q_nope, q_rope, ckv, kpe, pitch: int, scale: float, kv_scales=None) -> torch.Tensor:
        """`kv_scales`: the (latent, rope) dequantization scales of an FP8 cache, None for bf16/fp16."""
        if self.refused:
            raise PlanRefused(f"{self.backend}: {self.refused}")
        if self.engine is not None:
            int_workspace, plan_info, kv_indices = self.schedule(pitch)
            return self.engine.run(plan_info, int_workspace, q_nope, q_rope, ckv, kpe, kv_indices, self.causal, scale,
                                   kv_scales or (1.0, 1.0))
        fp8 = {} if kv_scales is None else {"ckv_scale": float(kv_scales[0]), "kpe_scale": float(kv_scales[1])}
        return self._wrapper(pitch, scale).run(query=(q_nope, q_rope), kv_cache=(ckv, kpe), **fp8)


def fa_step(plan, backend, device, num_heads, dtype, rank, rope, pitch, scale, kv_dtype=None) -> FaStep:
    """The step's `FaStep` for this device, backend, head count and dtypes (planned by the first layer)."""
    return plan.state(
        ("fa", device, backend, num_heads, dtype, rank, rope, kv_dtype or dtype),
        lambda: FaStep(paged_rows(plan, device), plan.q_len > 1, device, backend, num_heads, dtype, rank, rope,
                       (pitch,), scale, kv_dtype),
    )


def fa_backend_for_step(plan, backend, device, num_heads, dtype, rank, rope, pitch, scale, kv_dtype=None) -> str:
    """`backend` if FlashInfer accepts this step's plan, else fa2 if that accepts it, else ``"reference"``.

    FlashInfer refuses some plans outright (its causal tile bound for 2-8 query tokens at head counts that do
    not divide its query tile; its scheduler's work-item capacity). The step then runs elsewhere, after one
    warning per kind of refusal, rather than raising in the middle of a generation.
    """
    step = fa_step(plan, backend, device, num_heads, dtype, rank, rope, pitch, scale, kv_dtype)
    if step.refused is None:
        return backend
    fallback, reason = "reference", step.refused
    fp8 = (kv_dtype or dtype) != dtype  # only fa3's FP8 module is built ahead of time: no fa2 fallback for it
    if backend == "fa3" and not fp8 and unavailable_reason("fa2", device, dtype, rank, rope, num_heads) is None:
        fa2 = fa_step(plan, "fa2", device, num_heads, dtype, rank, rope, pitch, scale, kv_dtype)
        if fa2.refused is None:
            fallback = "fa2"
    logger.warning_once(
        f"flashinfer_mla: FlashInfer's {backend} declines some decode steps of {plan.q_len} query token(s) at "
        f"{num_heads} heads ({re.sub(r'[0-9]+', 'N', reason.split(':')[0])}); those steps run on {fallback}."
    )
    logger.debug("flashinfer_mla: %s refused a plan: %s", backend, reason)
    return fallback


def fa_decode(backend, plan, q_lat, q_pe, kv_latent, k_rot, scale, kv_scales=None) -> torch.Tensor:
    """``[B, H, Sq, L]`` latent query -> ``[B, H, Sq, L]`` latent output on fa3 or fa2 (planned once per step).

    An FP8 latent (`kv_scales` = its (latent, rope) scales) is read in place: FlashInfer dequantizes in the kernel."""
    q_nope, q_rope, ckv, kpe, pitch = kernel_inputs(q_lat, q_pe, kv_latent, k_rot)
    _, h, _, rank = q_lat.shape
    step = fa_step(plan, backend, q_lat.device, h, q_lat.dtype, rank, q_pe.shape[-1], pitch, scale, kv_latent.dtype)
    return latent_output(step.run(q_nope, q_rope, ckv, kpe, pitch, scale, kv_scales), q_lat.shape[0])
