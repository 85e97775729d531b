"""fa3/fa2 decode inside CUDA graphs (torch.compile, as ``generate(..., cache_implementation="static")`` does).

A replayed graph relaunches the kernels without running any Python, so the kernel must find each step's metadata in
buffers whose addresses never change. A `GraphSlot` holds them for one decode shape (device, backend, heads, dtype,
dims, scale, batch, query length, cache pitch): the page indices (the identity, for the rows of every mask
Transformers builds), and FlashInfer's integer workspace with the schedule. The attention runs through the custom
op `fa_decode_graph`, which dynamo and inductor treat as opaque. With a static cache Transformers builds the mask
in ``prepare_inputs_for_generation``, outside the compiled region, and the mask function re-plans every matching
slot there (`plan_graph_slots`) before the replay. Inside ``generate()`` that planning needs no device sync (the
rows are known on the host, ``metadata.py``), and the schedule reaches the slot's buffers by a copy ordered after
the previous replay on the stream.

``generate()`` waits for every step's tokens before it builds the next step, so a plan made there would add its
host time to every step. Instead the schedule of step t+1 is computed while the GPU replays step t: once
``generate()`` has queued step t and grown its mask, `StepPlan.plan_next` has each slot compute the next schedule
on the host into a pinned staging buffer of its own (`GraphSlot.ahead`); the replay in flight still reads the
slot's workspace, so step t+1's mask function only queues the copy, if that step's rows are the ones predicted.

Graphs that build the mask themselves (a forward the user compiled) are never re-planned before a replay: they
use the reference backend (`mask_planned_outside_graph`). So do shapes for which FlashInfer could refuse some
step's plan (`plan_always_accepted`): a replayed graph cannot switch backends.
"""

from __future__ import annotations

import concurrent.futures
import logging
import weakref

import torch
from torch._guards import TracingContext

from . import flashinfer_fa as fa
from .buffers import workspace_buffer
from .metadata import StepPlan, plan_of

logger = logging.getLogger("hf_flashinfer_mla")


class GraphSlot:
    """Fixed-address metadata of one decode shape, re-planned in place every step."""

    def __init__(self, key: tuple):
        device, backend, num_heads, dtype, rank, rope, scale, batch, q_len, pitch = key
        self.key, self.device, self.pitch, self.causal, self.scale = key, device, pitch, q_len > 1, scale
        self.dims = (num_heads, dtype, rank, rope)
        # The generated module addresses single-run rows through the identity (`PagedRows.addressing`): then only
        # the schedule changes per step. The public wrapper (and rows with holes) get explicit indices copied here.
        self.kv_indices = torch.arange(batch * pitch, dtype=torch.int32, device=device)
        self.identity = True
        self.plan_info = None  # as FlashInfer returned it (the launch takes it), and as a tuple (to compare)
        self.layout: tuple | None = None
        # The next step's schedule, computed on the host ahead of time (`ahead`): (ranges, q_len, plan info, its
        # layout, bytes staged in `self.staging`, a pinned scratch of this slot's own), uploaded by `plan` if the
        # rows match.
        self._ahead: tuple | None = None
        self.staging: torch.Tensor | None = None
        self._staging_read = None  # event: the GPU has copied the staging scratch's last schedule
        if fa.uses_generated_module():
            self.engine, self.wrapper = fa.generated_fa(device, backend, num_heads, dtype, rank, rope), None
            self.int_workspace = self.engine.new_workspace()  # the schedule, at a fixed address
        else:
            from flashinfer.mla import BatchMLAPagedAttentionWrapper

            i32 = dict(dtype=torch.int32, device=device)
            self.engine = None
            self.wrapper = BatchMLAPagedAttentionWrapper(
                workspace_buffer(device), use_cuda_graph=True, backend=backend,
                qo_indptr=torch.zeros(batch + 1, **i32), kv_indptr=torch.zeros(batch + 1, **i32),
                kv_indices=self.kv_indices, kv_len_arr=torch.zeros(batch, **i32),
            )

    def plan(self, plan: StepPlan) -> GraphSlot:
        """Write this step's schedule (and indices, where they are not the identity) into the slot's buffers
        (stream-ordered, no sync of its own): the schedule `ahead` computed for these rows if there is one, else a
        new one. Returns the slot (the step's state for it)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0].same_as(plan.ranges) and ahead[1] == plan.q_len:
            self._staging_read = fa.upload(self.staging, ahead[4], self.int_workspace)
            self._set_indices(None)
            return self._check_layout(*ahead[2:4])
        rows = fa.paged_rows(plan, self.device)
        try:
            if self.engine is None:
                indices = rows.kv_indices(self.pitch, self.device)
                fa.wrapper_plan(self.wrapper, rows, indices, self.causal, self.scale, *self.dims)
                self._set_indices(indices)
                return self
            # (not `rows.addressing`: its identity lives for the process, and this may run during CUDA-graph
            # warm-up, whose allocations belong to the graph's pool)
            indices = None if rows.first is not None else rows.kv_indices(self.pitch, self.device)
            plan_info = self.engine.plan(rows, rows.page_offsets(self.pitch), self.causal, self.int_workspace)
        except fa.PlanRefused as exc:
            # `plan_always_accepted` admitted this shape; a refusal means FlashInfer changed its rules.
            raise RuntimeError(f"FlashInfer refused a CUDA-graph decode plan it was expected to accept: {exc}. "
                               "Run without CUDA graphs (generate(..., disable_compile=True)).") from None
        self._set_indices(indices)
        return self._check_layout(plan_info, tuple(plan_info))

    def ahead(self, ranges, q_len: int) -> None:
        """Compute the next step's schedule for rows `ranges` now, on the host only: this step's replay still reads
        the slot's workspace, so `plan` uploads it at the next step, if that step's rows are these. Keeps nothing in
        the step's plan (returns None): the slot owns its staged schedule."""
        self._ahead = None
        if self.engine is None or q_len != self.key[8] or ranges.end > self.pitch:
            return
        if self.staging is None:
            pinned = self.device.type == "cuda"
            self.staging = torch.empty(fa.INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=pinned)
        elif self._staging_read is not None:
            self._staging_read.synchronize()  # its last upload, queued before this step's replay: long done
        rows = fa.rows_from_ranges(ranges, q_len)
        try:
            plan_info, staged = self.engine.schedule(rows, rows.page_offsets(self.pitch), self.causal,
                                                     self.int_workspace, self.staging)
        except fa.PlanRefused:
            return  # the next step plans (and reports) it itself
        self._ahead = (ranges, q_len, plan_info, tuple(plan_info), staged)  # (reading FlashInfer's array is slow)

    def _check_layout(self, plan_info, layout: tuple) -> GraphSlot:
        if self.plan_info is None:
            self.plan_info, self.layout = plan_info, layout
        elif layout != self.layout:
            # The captured launch holds the schedule's offsets and grid, fixed for a fixed batch and query shape.
            raise RuntimeError("FlashInfer's MLA schedule layout changed between steps of one CUDA-graph shape")
        return self

    def _set_indices(self, indices: torch.Tensor | None) -> None:
        """Explicit page indices into the fixed buffer, or (None) the identity back where explicit ones were."""
        if indices is not None:
            self.kv_indices[: indices.numel()].copy_(indices)
            self.identity = False
        elif not self.identity:
            self.kv_indices.copy_(torch.arange(self.kv_indices.numel(), dtype=torch.int32, device=self.device))
            self.identity = True

    def run(self, q_nope, q_rope, ckv, kpe) -> torch.Tensor:
        if self.engine is None:
            return self.wrapper.run(query=(q_nope, q_rope), kv_cache=(ckv, kpe))
        return self.engine.run(self.plan_info, self.int_workspace, q_nope, q_rope, ckv, kpe, self.kv_indices,
                               self.causal, self.scale)


_slots: dict[tuple, GraphSlot] = {}
# Graphs (by their dynamo tracing context) that build the attention mask themselves.
_graphs_building_masks: "weakref.WeakSet" = weakref.WeakSet()


def _plan_slot(plan: StepPlan, slot: GraphSlot) -> None:
    """Plan `slot` for `plan`'s step, once per step (the mask function and the op's eager runs share it)."""
    plan.state(("graph", slot.key), lambda: slot.plan(plan))


def plan_graph_slots(plan: StepPlan) -> None:
    """Re-plan the slots this step's mask applies to (called by the mask function, once per step)."""
    for slot in _slots.values():
        _, _, _, _, _, _, _, batch, q_len, pitch = slot.key
        if (batch, q_len, pitch) == (plan.batch_size, plan.q_len, plan.kv_len):
            _plan_slot(plan, slot)


# These run as plain Python while dynamo traces (their results are constants of the graph).
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
        logger.warning_once(
            "flashinfer_mla: this compiled graph builds its own attention mask, so FlashInfer cannot be planned "
            "before each CUDA-graph replay; its decode runs on the PyTorch reference backend. Use generate(..., "
            'cache_implementation="static"), which compiles the decode step and builds the mask outside the graph.'
        )
    return outside


@torch.compiler.assume_constant_result
def plan_always_accepted(device: str, batch: int, q_len: int, num_heads: int) -> bool:
    """Whether FlashInfer accepts the plan of every step of this shape, whatever the cached lengths.

    Its causal tile bound can refuse a step of 2-8 query tokens when a 64- or 128-row query tile ends inside a
    query token's heads (``_validate_fa_causal_tile_bound``); its scheduler holds at most `MAX_WORK_ITEMS` work
    items, and a step needs at most one per query tile plus one per cluster of SMs (the KV splits,
    ``scheduler.cuh``)."""
    tile_q = 128 if q_len * num_heads > 64 else 64
    tile_ends = range(tile_q, q_len * num_heads, tile_q)  # query tiles ending inside the step's query rows
    if q_len > 1 and any(end % num_heads for end in tile_ends):
        logger.warning_once(
            f"flashinfer_mla: FlashInfer may refuse causal plans of {q_len} query tokens at {num_heads} heads, and a "
            "CUDA graph cannot switch backends between replays: these graphs decode on the reference backend."
        )
        return False
    sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return fa.work_items_bound(batch, q_len, num_heads, sms) <= fa.MAX_WORK_ITEMS


def _outside_graph_pool(device: torch.device, build):
    """Run `build` (allocations that live for the process) on a helper thread, and wait for its GPU work.

    torch.compile's CUDA-graph trees route every allocation of the calling thread to the graph's private memory
    pool during warm-up, and refuse to capture while a tensor from that pool outlives it. A slot's buffers, the
    device workspace and FlashInfer's workspaces live for the process, so they are allocated from another thread,
    which the pool does not see.
    """

    if device.type != "cuda":
        return build()

    def run():
        torch.cuda.set_device(device)
        result = build()
        torch.cuda.synchronize(device)
        return result

    torch.cuda.current_stream(device).synchronize()  # the helper thread reads what this thread's stream wrote
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


@torch.library.custom_op("hf_flashinfer_mla::fa_decode_graph", mutates_args=())
def fa_decode_graph(
    backend: str, mask: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_latent: torch.Tensor,
    k_rot: torch.Tensor, scale: float,
) -> torch.Tensor:
    """`flashinfer_fa.fa_decode` for compiled graphs: metadata in a `GraphSlot`, planned by the mask function."""
    q_nope, q_rope, ckv, kpe, pitch = fa.kernel_inputs(q_lat, q_pe, kv_latent, k_rot)
    b, h, sq, rank = q_lat.shape
    device = q_lat.device
    key = (device, backend, h, q_lat.dtype, rank, q_pe.shape[-1], scale, b, sq, pitch)
    slot = _slots.get(key)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        # Eager execution (CUDA-graph trees' warm-up before capture, or a compile without CUDA graphs): plan now
        # unless the mask function already planned this slot for the step. Never while capturing: planning a
        # step from its mask may sync, and the mask function plans before every replay.
        plan = plan_of(mask) or StepPlan(mask)
        if slot is None:
            fa.paged_rows(plan, device)  # read on this thread, before the helper thread plans the new slot

            def build():
                new = GraphSlot(key)
                _plan_slot(plan, new)  # a first plan may allocate (FlashInfer's wrapper): outside the pool too
                return new

            slot = _slots[key] = _outside_graph_pool(device, build)
        _plan_slot(plan, slot)
    elif slot is None:
        raise RuntimeError("flashinfer_mla: a CUDA graph was captured before its decode ran once eagerly")
    return fa.latent_output(slot.run(q_nope, q_rope, ckv, kpe), b).contiguous()


@fa_decode_graph.register_fake
def _(backend, mask, q_lat, q_pe, kv_latent, k_rot, scale):
    return torch.empty_like(q_lat, memory_format=torch.contiguous_format)
