"""The step's plan: the one owner of a decode step's state, built once per forward step and shared by its layers.

Transformers builds one attention mask per forward step and hands the same tensor to every layer. The mask function
(``masks.py``) attaches a `StepPlan` to that tensor, so the plan lives exactly as long as its step's mask, and two
forwards (two models, or one model with two caches, inside one ``generate()``) never share one. It holds:

* the step's rows (``rows.py``): known on the host where the 2D mask says so, else read off the mask once;
* per layer shape (`Layer`), the `Route`: the backend chosen for it and that kernel's metadata, built by the
  first layer that needs it and run by every layer (`route`, the one place where a kernel's refusal moves a step
  down ``capabilities.fallbacks``);
* what it planned ahead for the next step (`plan_next`), handed on through the next 2D mask (``rows.GrowingMask``).

Inside compiled graphs the mask stands for the plan (``compiled.py``: the graph's custom op routes on it while
torch warms the graph up); before every replay the plan of the step reloads the CUDA-graph slots of its shape
(`load_graph_slots`, ``kernels/graphs.py``).

Models split across devices (accelerate's ``device_map``) receive at each layer on another device a *copy* of the
mask, without the plan. Such a copy adopts the plan of its model's current step (`step_plan`) instead of building
its own, so each device plans once per step.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

from . import capabilities
from .cache import FP8, dequantize_latent, latent_scales
from .kernels import Layer, Refused, cache_pitch, fa, graphs, reference, trtllm
from .rows import Rows, as_bool_mask

logger = logging.get_logger("hf_flashinfer_mla")

PLAN_ATTR = "_flashinfer_mla_plan"
# Each backend's builder and kernel (``kernels/__init__.py`` says what they are).
FAMILIES = {"reference": reference, "fa3": fa, "fa2": fa, "trtllm-gen": trtllm, "cute-dsl": trtllm}


@dataclass(eq=False)
class Route:
    """How the layers of one shape run this step: a backend, the layer spec its builder was given, its metadata,
    and the dtype to dequantize an FP8 latent to first (None: the kernel reads the cache as stored)."""

    backend: str
    layer: Layer
    meta: Any
    dequantize: torch.dtype | None = None

    def __post_init__(self):
        self.kernel = FAMILIES[self.backend].run

    def run(self, q_lat, q_pe, kv_latent, k_rot, indices=None, sinks=None) -> torch.Tensor:
        scales = None
        if self.dequantize is not None:
            kv_latent, k_rot = dequantize_latent(kv_latent, k_rot, self.dequantize)
        elif self.layer.kv_dtype == FP8:
            found = latent_scales(kv_latent)
            scales = (found.latent, found.rope)
        if sinks is not None:  # (only the reference takes sinks: kernels refuse them)
            return self.kernel(self.meta, self.layer, q_lat, q_pe, kv_latent, k_rot, scales, indices, sinks=sinks)
        return self.kernel(self.meta, self.layer, q_lat, q_pe, kv_latent, k_rot, scales, indices)


class Routing:
    """What the decode layers of one forward share to run: per layer shape, the `Route` built by the first such
    layer (`route`). A generate() step (`StepPlan`) and a continuous-batching step (``paged_attention.PagedStep``)
    are both one; kernel builders read them through ``rows()``, ``mask_on``, ``q_len`` and ``pages``."""

    q_len: int
    pages = None  # where a paged cache keeps each request's rows (``rows.PageTable``); None: the cache's own layout
    paged = False  # continuous batching's chain tries fa2 after the Blackwell kernels (``capabilities.fallbacks``)

    def __init__(self):
        self.routes: dict[tuple, Route] = {}
        self._ahead: dict[tuple, Any] = {}  # what the previous step planned for this one (`StepPlan.plan_next`)

    def rows(self) -> Rows:
        raise NotImplementedError

    def layer_of(self, q_lat, kv_latent, k_rot, scale: float, topk: int = 0, sinks: bool = False) -> Layer:
        """The `Layer` spec of one call on this step (its cache's pitch and packing read from the views' strides)."""
        return layer_of(q_lat, kv_latent, k_rot, scale, topk, sinks)

    def route(self, key: tuple, layer: Layer, requested: str, grad: bool) -> Route:
        """The step's `Route` for layers of this shape, built by the first such layer: the backend `requested`
        resolves to (``capabilities.choose_backend``), or the next one of its fallback chain that accepts the step.

        A step that autograd must differentiate (a training forward of <= 8 tokens) runs on the reference backend:
        FlashInfer's kernels have no backward, and gradients must not silently stop at the attention."""
        route = self.routes.get(key) or self._ahead.pop(("route", key), None)  # (or planned by the previous step)
        if route is None:
            backend = self.backend_for(layer, requested, grad)
            chain = capabilities.fallbacks(backend, layer.device, layer.dtype, layer.rank, layer.rope, layer.heads,
                                           layer.kv_dtype == FP8, self.paged)
            route = first_accepting(
                chain, layer, lambda candidate, reads: FAMILIES[candidate].build(candidate, self, reads), self.q_len)
        self.routes[key] = route
        return route

    @staticmethod
    def backend_for(layer: Layer, requested: str, grad: bool) -> str:
        backend = capabilities.choose_backend(layer.device, layer.dtype, layer.rank, layer.rope, layer.heads,
                                              requested)
        if grad and backend != "reference":
            logger.warning_once(
                f"flashinfer_mla: a decode step ran with autograd recording, so it used the PyTorch reference backend "
                f"instead of {backend} (FlashInfer's kernels have no backward). For inference, run under "
                "torch.no_grad() or torch.inference_mode(), as generate() does."
            )
            return "reference"
        return backend


class StepPlan(Routing):
    """Everything the decode layers of one forward step share, on every device the model runs on."""

    def __init__(self, mask: torch.Tensor, rows: Rows | None = None, config=None):
        super().__init__()
        if mask.dim() != 4:
            raise ValueError(f"expected a 4D attention mask [batch, 1, q_len, kv_len], got shape {tuple(mask.shape)}")
        self.source_shape, self.source_dtype = tuple(mask.shape), mask.dtype
        # A mask that carries its plan (`attach_plan`) owns it, and the plan then holds that mask weakly: a cycle
        # would keep every step's masks and metadata alive until Python's garbage collector runs, freeing device
        # memory at random moments; the next generate()'s static cache then lands elsewhere, and CUDA graphs record
        # again. Masks the plan makes (a boolean copy of an additive mask, copies for other devices) are its own.
        as_bool = as_bool_mask(mask)
        self._mask = weakref.ref(as_bool)
        self._masks: dict[tuple, torch.Tensor] = {(as_bool.device, False): as_bool}
        # An additive (float) mask, held as its boolean copy is: it may add a bias to the scores (`Rows.refusal`),
        # which only the reference can add (`mask_on(device, additive=True)`).
        self._additive = None if as_bool is mask else weakref.ref(mask)
        self.batch_size, _, self.q_len, self.kv_len = mask.shape
        self.device = mask.device
        self._rows = rows
        self.config = config  # of the model whose mask function built it (None: a mask from elsewhere)
        self._loaded: set[tuple] = set()  # graph slots this step has loaded
        self.slot_refusals: dict[tuple, str] = {}  # slots of this shape whose kernel cannot serve this step
        # The attention modules that ran on this plan (by id), with their layer_idx (see `step_plan`).
        self.consumers: dict[int, int] = {}

    # A copy of the step's mask (``copy.deepcopy`` of a forward's inputs, as Transformers' exporters take them;
    # pickling) is another tensor: it gets no copy of this plan, which names the original mask, and is planned from
    # its own contents when a model runs on it (`step_plan`).
    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return type(None), ()

    # ------------------------------------------------------------------------------------------- what builders read
    @property
    def mask(self) -> torch.Tensor:
        """The step's mask, ``[B, 1, Sq, Skv]`` bool, True = attend (alive while its step runs)."""
        mask = self._mask()
        if mask is None:
            raise RuntimeError("flashinfer_mla: a step's plan outlived its attention mask")
        return mask

    def additive_mask(self) -> torch.Tensor | None:
        """The float mask the model passed (None: it passed a boolean one)."""
        mask = None if self._additive is None else self._additive()
        if mask is None and self._additive is not None:
            raise RuntimeError("flashinfer_mla: a step's plan outlived its attention mask")
        return mask

    def rows(self) -> Rows:
        """The step's rows: known on the host (no sync), or read off the mask once."""
        if self._rows is None:
            self._rows = Rows.from_mask(self.mask[:, 0, -1, :], self.q_len, self.mask, self.additive_mask())
        return self._rows

    def mask_on(self, device: torch.device, additive: bool = False) -> torch.Tensor:
        """The mask on `device` (copied once per device and step, for models split across GPUs); `additive`: the
        mask as the model passed it where that was a float mask, whose values the reference adds to the scores. A
        builder keeps it weakly (``weakref.ref``), as the plan keeps its own mask."""
        source = self.additive_mask() if additive else None
        key = (device, source is not None)
        if key not in self._masks:
            mask = self.mask if source is None else source
            if mask.device == device:
                return mask
            self._masks[key] = mask.to(device, non_blocking=True)
        return self._masks[key]

    # ------------------------------------------------------------------------------------------- graph slots
    def load_graph_slots(self, replaying: bool = False) -> None:
        """Reload every CUDA-graph slot of this step's shape with its metadata, before a compiled step may replay
        (called by the mask function, outside the compiled region: a replay runs no Python). A slot whose kernel
        cannot serve this step is recorded, and raises only where a replay is known to follow (`replaying`:
        generate()'s compiled step, ``generation.py``), so an uncompiled step of the same shape still runs."""
        for key, slot in graphs.slots_for(self.batch_size, self.q_len, self.kv_len):
            try:
                self.load_slot(key, slot)
            except graphs.SlotRefused as exc:
                self.slot_refusals[key] = str(exc)
        if replaying and self.slot_refusals:
            raise graphs.SlotRefused(next(iter(self.slot_refusals.values())))

    def load_slot(self, key: tuple, slot, built: bool = False) -> None:
        """Load this step's metadata into a CUDA-graph slot of its shape, unless it holds it already (`built`: the
        slot was just made, or its shape runs the reference: nothing to load)."""
        # (another forward of the same shape may have loaded the slot since this plan did: the guidance forward of
        # classifier-free guidance, a second model of a logits processor)
        if not built and (key not in self._loaded or slot.holder() is not self):
            slot.load(self, self._ahead.pop(("slot", key), None))
        self._loaded.add(key)

    # ------------------------------------------------------------------------------------------ planning ahead
    def plan_next(self, growing) -> None:
        """Plan the next step now, for the rows of `growing` (the next 2D mask): called by ``generate()``'s mask
        update once it has queued this step, so that the host plans while the GPU still runs this step (it would
        otherwise plan after ``generate()`` has waited for this step's tokens). The next step's mask and plan, with
        what each kernel can plan ahead (``ahead`` of its family) and its CUDA-graph slots reloaded (stream-ordered
        after this step's replay), wait on `growing` for the mask function to hand them out
        (`GrowingMask.take_next`)."""
        rows = (growing.rows(self.q_len, max(self.kv_len, growing.width))  # (a dynamic cache grows to the width)
                if self._rows is not None and self._rows.end else None)
        kv_len = self.kv_len if rows is None or self.kv_len > self._rows.end else growing.width  # static, or growing
        if rows is None or growing.width > kv_len:
            return  # rows not known ahead, or a full static cache: there is no next step
        mask = growing.mask(self.batch_size, self.q_len, kv_len, self.device)
        step = attach_plan(mask, rows, self.config, current=False)
        for key, route in self.routes.items():
            ahead = getattr(FAMILIES[route.backend], "ahead", None)
            meta = None if ahead is None else ahead(route.meta, rows, route.layer)
            if meta is not None:
                step._ahead[("route", key)] = dataclasses.replace(route, meta=meta)
        for key, slot in graphs.slots_for(self.batch_size, self.q_len, self.kv_len):
            staged = slot.ahead(rows) if key in self._loaded else None
            if staged is not None:
                step._ahead[("slot", key)] = staged
        step.load_graph_slots()
        growing.next_step = ((self.batch_size, self.q_len, kv_len, self.device, id(self.config)), mask, step)

    # ---------------------------------------------------------------------------------------- device adoption
    def make_current(self) -> None:
        """This is its model's step in progress (for plan-less copies of its mask, `step_plan`)."""
        if self.config is not None:
            _current[id(self.config)] = weakref.ref(self)

    def adoptable_by(self, mask: torch.Tensor, module) -> bool:
        """Whether a plan-less `mask` reaching `module` is a copy of this plan's mask made for this very step:
        it has the plan's shape and dtype, the plan belongs to `module`'s model, another layer already runs on it
        (a plan no layer ran on, such as a compiled step's, is no step in progress) and `module` has not run on it
        yet and comes after the layers that did (a layer that already ran on it is at a new step; an earlier layer
        is another model's, built on the same config object, with a mask of its own)."""
        idx = getattr(module, "layer_idx", None)  # (None on an attention module built without one: no order)
        return (
            bool(self.consumers)
            and (idx is None or idx > max(self.consumers.values()))
            and tuple(mask.shape) == self.source_shape
            and mask.dtype == self.source_dtype
            and module.config is self.config
            and id(module) not in self.consumers
        )


def _reads_in_place(backend: str, layer: Layer) -> bool:
    """Whether `backend` reads the cache as stored: anything but an FP8 latent, which only fa3 reads in place (bf16
    queries); every other backend reads it dequantized."""
    return layer.kv_dtype != FP8 or (backend == "fa3" and layer.dtype == torch.bfloat16)


def first_accepting(chain, layer: Layer, build, q_len: int) -> Route:
    """The `Route` of the first backend of `chain` whose builder accepts the step (``build(backend, layer spec)``
    returns its metadata or raises `Refused`): the one place where a refusal moves a step down its fallback chain,
    for every step (`Routing.route`). Each kind of refusal is reported once."""
    refusals = []
    for candidate in chain:
        reads = layer if _reads_in_place(candidate, layer) else dataclasses.replace(
            layer, kv_dtype=layer.dtype, packed=False)
        try:
            meta = build(candidate, reads)
        except Refused as exc:
            refusals.append((candidate, str(exc)))
            continue
        route = Route(candidate, reads, meta, None if reads is layer else layer.dtype)
        _report(refusals, route, q_len, layer)
        return route
    raise AssertionError(f"every backend of {chain} refused, the reference included: {refusals}")


def _report(refusals: list, route: Route, q_len: int, layer: Layer) -> None:
    """One warning per kind of refusal: the backends that refused for one reason together, numbers folded, so that
    a step of another length or at another context does not warn again; and one for an FP8 latent that the chosen
    kernel reads dequantized."""
    by_reason: dict[str, list[str]] = {}
    for backend, reason in refusals:
        by_reason.setdefault(re.sub(r"[0-9]+", "N", reason.split(":")[0]), []).append(backend)
        logger.debug("flashinfer_mla: %s refused a plan of %d query token(s): %s", backend, q_len, reason)
    for reason, backends in by_reason.items():
        verb = "declines" if len(backends) == 1 else "decline"
        logger.warning_once(
            f"flashinfer_mla: {' and '.join(backends)} {verb} some decode steps at {layer.heads} heads ({reason}); "
            f"those steps run on {route.backend}."
        )
    if route.dequantize is not None:
        logger.warning_once(
            f"flashinfer_mla: the {route.backend} backend cannot read the FP8 latent in place (FlashInfer's fa3 on "
            "Hopper with bfloat16 queries can); it dequantizes the whole cached latent on every decode step."
        )


# The current step of each model (by its config), for plan-less copies of its mask made for layers on another
# device (weak: a finished step's plan is freed with its mask).
_current: dict[int, weakref.ref] = {}


def attach_plan(mask: torch.Tensor, rows: Rows | None = None, config=None, current: bool = True) -> StepPlan:
    """Build the plan for this step's `mask` and attach it to the tensor; `current`: it is its model's current
    step (False for a step planned ahead, which becomes current when the mask function hands it out)."""
    plan = StepPlan(mask, rows, config)
    if mask.dtype == torch.bool:
        del plan._masks[(mask.device, False)]  # the mask owns the plan: held weakly from here on
    setattr(mask, PLAN_ATTR, plan)
    if current:
        plan.make_current()
    return plan


def plan_of(mask: torch.Tensor) -> StepPlan | None:
    return getattr(mask, PLAN_ATTR, None)


def step_plan(mask: torch.Tensor, module) -> StepPlan:
    """The plan of the step `mask` belongs to, as seen by the attention `module`: the one attached to it; for a copy
    made for another device, the plan of its model's current step; for any other mask (a 4D mask of the user's
    own) an exact plan of its own. A plan `module` already ran on is another step's: the tensor is a mask that a
    loop rewrites in place for every step (one buffer of a static cache's shape), so it is planned again from
    what it holds now."""
    plan = getattr(mask, PLAN_ATTR, None)
    if plan is None or id(module) in plan.consumers:
        ref = _current.get(id(module.config))
        current = ref() if ref is not None and plan is None else None
        if current is not None and current.adoptable_by(mask, module):
            plan = current
        else:
            plan = attach_plan(mask, config=module.config)
            # The caller builds its masks without the mask function: a graph it compiles next must not take the
            # plan the mask function noted last (a step of another loop, alive still) for one of its own masks,
            # whose CUDA-graph slots the mask function reloads before each replay (``kernels/graphs.py``).
            graphs.note_mask_planned(None)
    plan.consumers[id(module)] = getattr(module, "layer_idx", None) or 0
    return plan


def decode_latent(plan: StepPlan, requested: str, q_lat, q_pe, kv_latent, k_rot, scale: float,
                  indices: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's decode on the step `plan`, routed as the attention function routes it (for benchmarks and
    tests that drive a kernel without a model): ``[B, H, Sq, L]`` latent query and ``[B, H, Sq, R]`` rotary query
    -> ``[B, H, Sq, L]`` latent output; `indices` ``[B, Sq, topk]``: a sparse layer's selection."""
    b, h, sq, rank = q_lat.shape
    q_lat, q_pe = q_lat.transpose(0, 1).reshape(h, b * sq, rank), q_pe.transpose(1, 2).reshape(b * sq, h, -1)
    layer = layer_of(q_lat, kv_latent, k_rot, scale, 0 if indices is None else indices.shape[-1])
    out = plan.route((layer, requested), layer, requested, False).run(q_lat, q_pe, kv_latent, k_rot, indices)
    return out.view(h, b, sq, rank).transpose(0, 1)


def layer_of(q_lat, kv_latent, k_rot, scale: float, topk: int = 0, sinks: bool = False) -> Layer:
    """The `Layer` spec of one call (its cache's pitch and packing read from the views' strides)."""
    return Layer(q_lat.device, q_lat.dtype, kv_latent.dtype, q_lat.shape[0], kv_latent.shape[-1], k_rot.shape[-1],
                 cache_pitch(kv_latent), trtllm.packed_pages(kv_latent, k_rot) is not None, scale, topk, sinks)
