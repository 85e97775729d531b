"""generate()'s compiled decode step (``generate(..., cache_implementation="static")``: torch.compile with CUDA
graphs), in one place.

* While dynamo traces a decode layer (`decode_traced`, from ``decode.decode_layer``): a graph whose mask the mask
  function planned outside it (generate()'s static-cache step) calls the custom op `decode_in_graph`; any other
  graph, and a sparse, sink or autograd-recorded layer, runs the reference inline.
* The op, opaque to dynamo and inductor (so the graph may have any batch size): while torch warms the graph up it
  routes on the step's plan (`route_in_graph`: the CUDA-graph slot of its shape, ``kernels/graphs.py``, or the
  reference); while the graph is captured it runs the route chosen then.
* Before every replay the step's plan reloads the slots of its shape (the mask function calls
  ``StepPlan.load_graph_slots``); generate()'s compiled call raises where a slot's kernel cannot serve the step,
  since a replay cannot switch backends (`slots_checked_before_compiled_steps`).

Continuous batching replays Transformers' own graphs on the same slots (``paged_attention.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from . import capabilities
from .cache import FP8
from .errors import CacheLayoutError
from .kernels import Layer, graphs, reference
from .models import ATTN_NAME
from .plan import FAMILIES, StepPlan, layer_of, plan_of


def decode_traced(module, mask, q_lat, q_pe, kv_latent, k_rot, scale, mla_backend, grad, indices, sinks):
    """A decode layer being traced by torch.compile. generate()'s static-cache graphs receive their mask from outside
    and run the custom op, which routes each compiled shape on its step's plan; a graph that builds its own mask, one
    autograd must differentiate, or a sparse or sink layer's, runs the reference backend inline."""
    if kv_latent.dtype == FP8:
        raise CacheLayoutError(
            "the FP8 latent cache (MLALatentCache(dtype=torch.float8_e4m3fn)) does not run inside torch.compile "
            "or CUDA graphs yet; generate without compiling, or use the bf16 cache (cache_implementation="
            '"static") for CUDA graphs.'
        )
    if indices is not None:
        return reference.attend_sparse(mask, indices, scale, q_lat, q_pe, kv_latent, k_rot, sinks)
    if grad or sinks is not None or not graphs.mask_planned_outside_graph():
        return reference.attend(mask, scale, q_lat, q_pe, kv_latent, k_rot, sinks)
    requested = mla_backend or capabilities.load_backend(module.config) or ""
    return torch.ops.hf_flashinfer_mla.decode_in_graph(mask, q_lat, q_pe, kv_latent, k_rot, scale, requested)


@torch.library.custom_op("hf_flashinfer_mla::decode_in_graph", mutates_args=())
def decode_in_graph(mask: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_latent: torch.Tensor,
                    k_rot: torch.Tensor, scale: float, requested: str) -> torch.Tensor:
    """A decode step inside a compiled graph: while torch warms the graph up it runs eagerly and routes on the
    step's plan; while it is captured it runs the slot chosen then, whose metadata the plan reloads before every
    replay."""
    layer = layer_of(q_lat, kv_latent, k_rot, scale)
    key = (layer, mask.shape[0], mask.shape[2], mask.shape[3])
    if layer.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        route = graphs.routes[key]
    else:
        # Warm-up (never while capturing: planning from the mask may sync): CUDA-graph trees hand the graph copies
        # of its inputs, so the mask may have lost its plan; it is then planned from its contents.
        plan = plan_of(mask) or StepPlan(mask)
        route = graphs.routes[key] = route_in_graph(plan, key, layer, capabilities.requested_backend(requested or None))
    return route.run(q_lat, q_pe, kv_latent, k_rot, mask).contiguous()


@decode_in_graph.register_fake
def _(mask, q_lat, q_pe, kv_latent, k_rot, scale, requested):
    return torch.empty_like(q_lat, memory_format=torch.contiguous_format)


@dataclass(eq=False)
class GraphSlotRoute:
    """What a compiled decode shape runs: its CUDA-graph slot, or the reference backend on the step's mask."""

    backend: str
    slot: Any
    layer: Layer

    def run(self, q_lat, q_pe, kv_latent, k_rot, mask) -> torch.Tensor:
        if self.backend == "reference":
            return reference.run(mask, self.layer, q_lat, q_pe, kv_latent, k_rot)
        return self.slot.run(q_lat, q_pe, kv_latent, k_rot)


def route_in_graph(plan: StepPlan, key: tuple, layer: Layer, requested: str) -> GraphSlotRoute:
    """The route of a compiled decode step while torch warms its graph up: the slot of this shape on the backend
    the step would take (its metadata at fixed addresses, loaded for this step), or the reference backend."""
    backend = plan.backend_for(layer, requested, False)
    # (a float mask's bias and a mask per head are what `route`'s rows would refuse; a slot reads no rows)
    mask_fits = plan.source_dtype == torch.bool and plan.source_shape[1] == 1
    if layer.kv_dtype == FP8 or backend == "reference" or not mask_fits:
        return GraphSlotRoute("reference", None, layer)
    slot_key = (backend, layer, plan.batch_size, plan.q_len, plan.kv_len)
    fresh = slot_key not in graphs._slots
    slot = graphs.slot(slot_key, FAMILIES[backend], backend, layer, plan)
    plan.load_slot(slot_key, slot, built=fresh or not isinstance(slot, graphs.GraphSlot))
    return GraphSlotRoute(backend if isinstance(slot, graphs.GraphSlot) else "reference", slot, layer)


def slots_checked_before_compiled_steps(original):
    # A replayed CUDA graph runs no Python: the mask function loads the kernels' fixed-address metadata
    # (kernels/graphs.py) for every step of a captured shape, compiled or not, and records a step a slot's kernel
    # cannot serve, without raising (an uncompiled step of that shape runs anyway). generate() gets its compiled
    # step here: this wrapper raises for such a step, which it knows will replay.
    @functools.wraps(original)
    def get_compiled_call(self, compile_config):
        compiled = original(self, compile_config)
        if self.config.get_text_config(decoder=True)._attn_implementation != ATTN_NAME:
            return compiled

        def compiled_step(*args, **kwargs):
            masks = kwargs.get("attention_mask")
            for mask in masks.values() if isinstance(masks, dict) else (masks,):
                plan = plan_of(mask) if isinstance(mask, torch.Tensor) else None
                if plan is not None:
                    plan.load_graph_slots(replaying=True)
            try:
                return compiled(*args, **kwargs)
            finally:
                graphs.note_mask_planned(None)

        return compiled_step

    return get_compiled_call
