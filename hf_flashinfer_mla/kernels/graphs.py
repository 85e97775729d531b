"""Decode inside CUDA graphs (torch.compile, as ``generate(..., cache_implementation="static")`` runs it), for every
kernel family through one mechanism.

A replayed graph relaunches the kernels without running any Python, so a kernel must find each step's metadata in
buffers whose addresses never change. A `GraphSlot` holds them for one decode shape (backend, layer, batch, query
length): each family allocates them (``fixed``: fa2/fa3's schedule workspace and page indices, trtllm-gen's block
tables, lengths and counter buffer) and its builder rebuilds them in place (``build(..., into=...)``). With a
static cache Transformers builds the mask in ``prepare_inputs_for_generation``, outside the compiled region; the
step's plan (``plan.py``) reloads every slot of its shape there, before the replay, stream-ordered.

The slots are a documented process-wide cache, like ``buffers.py``: a captured graph holds their addresses for as
long as it lives. They hold no step's state beyond what the last step wrote into them.

A shape is captured on a kernel only if no step of that shape can be refused (``refusal_for_every_step``: a replay
cannot switch backends); any other shape is captured on the reference backend, after one warning.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import weakref
from typing import NamedTuple

import torch
import transformers.utils.logging  # noqa: F401  (gives logging.Logger its warning_once)
from torch._guards import TracingContext

from . import Refused

logger = logging.getLogger("hf_flashinfer_mla")


def _nobody():
    return None


class SlotRefused(RuntimeError):
    """A slot's kernel cannot serve a step of its shape; raised where a replay of its graph would follow."""


class GraphSlot:
    """Fixed-address metadata of one decode shape on one kernel, rebuilt in place every step."""

    def __init__(self, family, backend: str, layer, batch: int, q_len: int):
        self.family, self.backend, self.layer, self.batch, self.q_len = family, backend, layer, batch, q_len
        self.meta = family.fixed(backend, layer, batch, q_len)
        self.holder = _nobody  # (weakly) the step whose metadata the buffers hold

    def load(self, step, staged=None) -> None:
        """This step's metadata into the slot's buffers. A step the kernel declines cannot switch backends in a
        replayed graph, so it raises, naming the way out (for instance trtllm-gen with left padding that does not
        start on a page, in a shape captured with aligned rows)."""
        self.holder = _nobody
        try:
            self.family.build(self.backend, step, self.layer, into=self.meta, staged=staged)
            self.holder = weakref.ref(step)
        except Refused as exc:
            raise SlotRefused(
                f"flashinfer_mla: {self.backend} cannot run this step of a CUDA graph captured on it ({exc}), and a "
                "replayed graph cannot switch backends; generate with disable_compile=True (or without padding) for "
                "such batches.") from None

    def ahead(self, rows):
        ahead = getattr(self.family, "ahead", None)
        return None if ahead is None else ahead(self.meta, rows, self.layer)

    def run(self, q_lat, q_pe, kv_latent, k_rot) -> torch.Tensor:
        return self.family.run(self.meta, self.layer, q_lat, q_pe, kv_latent, k_rot)


# (backend, layer, batch, q_len, mask length) -> its slot, or "reference" for a shape captured on the reference
# backend. The mask length is a static cache's length: two caches of one capacity are two graphs, two slots.
_slots: dict[tuple, GraphSlot | str] = {}
# (layer, batch, q_len, mask length) -> the route that shape's graph was warmed up with, which its capture records
# (``compiled.decode_in_graph`` fills it; it names a slot and holds no step's state).
routes: dict[tuple, object] = {}


class CapturedShape(NamedTuple):
    backend: str  # the backend the shape's steps chose
    runs: str  # what its graphs run: that backend, or "reference" (see `slot`)
    heads: int
    batch: int
    q_len: int
    kv_len: int  # the static cache's length


def captured_shapes() -> list[CapturedShape]:
    """Every decode shape compiled with CUDA graphs in this process, and the backend its graphs run on."""
    return [CapturedShape(key[0], key[0] if isinstance(s, GraphSlot) else "reference", key[1].heads, *key[2:])
            for key, s in _slots.items()]


def reset() -> None:
    """Forget every slot and route. Only safe once no captured graph can replay (`hf_flashinfer_mla.reset` resets
    torch's compiled code and CUDA graphs first): a replay would read the freed buffers."""
    _slots.clear()
    routes.clear()


def slots_for(batch: int, q_len: int, kv_len: int) -> list[tuple[tuple, GraphSlot]]:
    """The slots a step of this shape must reload before its replay."""
    return [(key, slot) for key, slot in _slots.items() if isinstance(slot, GraphSlot) and key[2:] == (batch, q_len,
                                                                                                         kv_len)]


def slot(key: tuple, family, backend: str, layer, step) -> GraphSlot | str:
    """The slot of this step's shape, made and first loaded on first use (outside the graph's memory pool: a first
    plan may allocate too); "reference" where the family may refuse some step of the shape or cannot hold its
    metadata at fixed addresses."""
    if key not in _slots:
        batch, q_len = step.batch_size, step.q_len
        reason = family.refusal_for_every_step(layer, batch, q_len)
        if reason is None:
            step.rows()  # read here, on this thread, before the helper thread plans the new slot

            def build():
                new = GraphSlot(family, backend, layer, batch, q_len)
                family.build(backend, step, layer, into=new.meta)  # (a first step declined: capture the reference)
                new.holder = weakref.ref(step)
                return new

            try:
                _slots[key] = _outside_graph_pool(layer.device, build)
            except Refused as exc:
                reason = str(exc)
        if reason is not None:
            logger.warning(
                "flashinfer_mla: CUDA graphs of this decode shape (batch %d, %d query token(s), %d heads) run on the "
                "reference backend, not %s: %s; a replayed graph cannot switch backends between steps.",
                batch, q_len, layer.heads, backend, reason)
            _slots[key] = "reference"
    return _slots[key]


def _outside_graph_pool(device: torch.device, build):
    """Run `build` (allocations that live for the process) on a helper thread, and wait for its GPU work.

    torch.compile's CUDA-graph trees route every allocation of the calling thread to the graph's private memory
    pool during warm-up, and refuse to capture while a tensor from that pool outlives it. A slot's buffers and
    FlashInfer's workspaces live for the process, so they are allocated from another thread, which the pool does
    not see.
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


# Graphs (by their dynamo tracing context) that build the attention mask themselves.
_graphs_building_masks: "weakref.WeakSet" = weakref.WeakSet()
# The plan of the decode mask the mask function built last on this thread (weak). A graph traced while that plan is
# alive and unused receives its mask from the mask function, which reloads the graph's slots before every replay.
_planned = threading.local()


def note_mask_planned(plan) -> None:
    """Called by the mask function for every decode mask it plans, outside compiled regions; None (generate()'s
    compiled step, once it returns) forgets it, so that a graph compiled later by other code is not taken for one
    of generate()'s."""
    _planned.ref = None if plan is None else weakref.ref(plan)


# These run as plain Python while dynamo traces (their results are constants of the graph; they take no sizes).
@torch.compiler.assume_constant_result
def note_mask_built_in_graph() -> bool:
    """Called by the mask function while dynamo traces it (a user compiled the model's forward itself)."""
    context = TracingContext.try_get()
    if context is not None:
        _graphs_building_masks.add(context)
    return True


@torch.compiler.assume_constant_result
def mask_planned_outside_graph() -> bool:
    """Whether the graph being traced receives a mask that the mask function planned outside it, as generate()
    does with a static cache (the mask function reloads the slots before every step). Other graphs run the reference
    backend instead, since a replayed CUDA graph would run on the metadata of the step it was captured at: graphs
    that build their own mask, and graphs handed a 4D mask the mask function never saw (a loop of the user's own;
    the plan noted last is then missing, or is one that layers already ran on, an uncompiled step's)."""
    context = TracingContext.try_get()
    if context is not None and context in _graphs_building_masks:
        logger.warning_once(
            "flashinfer_mla: this compiled graph builds its own attention mask, so no kernel can be planned before "
            "each CUDA-graph replay; its decode runs on the PyTorch reference backend. Use generate(..., "
            'cache_implementation="static"), which compiles the decode step and builds the mask outside the graph.'
        )
        return False
    ref = getattr(_planned, "ref", None)
    plan = ref() if ref is not None else None
    if plan is None or plan.consumers:
        logger.warning_once(
            "flashinfer_mla: this compiled graph is handed a 4D attention mask that flashinfer_mla's mask function "
            "did not build, so nothing reloads its kernels' metadata before a CUDA-graph replay; its decode runs on "
            "the PyTorch reference backend. Pass the 2D padding mask and build the 4D mask outside the graph with "
            "transformers.masking_utils.create_masks_for_generate, as generate(..., cache_implementation=\"static\") "
            "does."
        )
        return False
    return True
