"""The one per-layer decode routine: absorb ``kv_b_proj`` into the query -> run the step's route -> project.

Every caller decodes a layer here: ``generate()``'s steps (the step's plan rides on the mask, ``plan.StepPlan``),
continuous batching's (``paged_attention.PagedStep``, over the paged latent cache) and compiled steps (``compiled.py``:
the custom op that runs the step's CUDA-graph slot). The step owns its routes; the first layer of each
shape (`RouteKey`) builds one, every other layer looks it up and only launches, as vLLM's MLA backends split a
metadata builder (once per batch) from the kernel call (per layer).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .absorption import AbsorbedWeights, absorb_query, project_output
from .capabilities import requested_backend
from .compiled import decode_traced
from .errors import CacheLayoutError
from .plan import Routing


class RouteKey(NamedTuple):
    """A layer's shape as its step's routes are keyed: the layers of one key share one `plan.Route`. (A named tuple,
    not a dataclass: it is built for every layer of every step, where a tuple's construction and hash are cheapest.)"""

    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    heads: int
    rank: int
    rope: int
    batch_stride: int  # the cache's strides: its pitch and packing
    row_stride: int
    batch: int
    scale: float
    requested: str | None  # mla_backend= of the call
    grad: bool
    topk: int
    sinks: bool


def decode_layer(module, step: Routing | None, query: torch.Tensor, kv_latent: torch.Tensor, k_rot: torch.Tensor,
                 weights: AbsorbedWeights, scale: float, mla_backend: str | None = None,
                 indices: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's absorbed decode: ``query [B, H, Sq, qk_head_dim]`` over the latent views ``[B, 1, S, L]`` and
    ``[B, 1, S, R]`` -> ``[B, Sq, H, v_head_dim]``. `step`: the forward's `plan.Routing` (None while torch.compile
    traces, where the step's `mask` stands for it); `indices`: a sparse layer's selection; `sinks`: ``s_aux``."""
    q_lat, q_pe = absorb_query(query, module.qk_nope_head_dim, weights)  # [H, B*Sq, L], [B*Sq, H, R]
    # (autograd must differentiate the attention: FlashInfer's kernels have no backward, the reference has)
    grad = torch.is_grad_enabled() and (q_lat.requires_grad or kv_latent.requires_grad or k_rot.requires_grad)
    topk = 0 if indices is None else indices.shape[-1]
    if step is None:
        o_lat = decode_traced(module, mask, q_lat, q_pe, kv_latent, k_rot, scale, mla_backend, grad, indices, sinks)
    else:
        key = RouteKey(q_lat.device, q_lat.dtype, kv_latent.dtype, q_lat.shape[0], kv_latent.shape[-1],
                       k_rot.shape[-1], kv_latent.stride(0), kv_latent.stride(2), kv_latent.shape[0], scale,
                       mla_backend, grad, topk, sinks is not None)
        route = step.routes.get(key)
        if route is None:
            if kv_latent.shape[0] > 1 and (kv_latent.stride(0) // kv_latent.stride(2)
                                           != k_rot.stride(0) // k_rot.stride(2)):
                raise CacheLayoutError("the latent and rope caches disagree on the rows between two sequences")
            route = step.route(key, step.layer_of(q_lat, kv_latent, k_rot, scale, topk, sinks is not None),
                               requested_backend(mla_backend, module.config), grad)
        o_lat = route.run(q_lat, q_pe, kv_latent, k_rot, indices, sinks)
    return project_output(o_lat, weights, query.shape[0])
