"""Per-step planning: which cached positions each sequence attends to, decided once per forward step.

Transformers builds one attention mask per forward step and hands the same tensor to every layer. The mask
function registered for ``flashinfer_mla`` (`flashinfer_mla_mask`, registered by ``registration.py``) builds that
mask as a dense boolean tensor and attaches a `StepPlan` to it; every layer then reads the plan off the mask it
receives (`step_plan`). The `StepPlan` is the one carrier of per-step state: the mask, the rows each sequence
attends to, the backend chosen for the step, and per device the kernel metadata (for FlashInfer: the paged rows
and the native plan) built by the first layer that needs it. It lives as long as the mask of its step (the latest
plan of a thread is also kept for adoption, see below, until the next step's plan or the end of generate()).

Rows known on the host. Planning FlashInfer needs each sequence's number of valid cached tokens on the host.
Reading them off the mask costs a device-to-host copy, i.e. a sync that stalls the host until the GPU has caught
up. Inside ``generate()`` that is not needed: after the prompt, Transformers only ever appends ones to (or crops
from the right of) the 2D padding mask, so a row's valid positions are ``[first_b, W)`` where ``first_b`` (its left
padding) is fixed for the call and ``W`` (the 2D mask's width) is a host integer. `first_b` is read once per
``generate()`` call (one sync, at the first decode step) and every later step is planned without any sync
(`KVRanges`). Everywhere else (a forward loop of the user's own, a 4D mask passed by the user, padding with holes)
the plan is derived exactly from the mask, as before. A mask without a padding part (no 2D mask) is pure causal
and its rows are known on the host anywhere.

Planning ahead. ``generate()`` waits for every step's tokens (its stopping criteria read them) before it builds
the next step, so whatever the host does between the two is added to every step while the GPU idles. Once a step
is queued, ``generate()`` grows its 2D mask by the new token (``_update_model_kwargs_for_generation``); there the
next step's rows are known, and `StepPlan.plan_next` plans that step while the GPU still runs this one. The next
step's plan takes those states over only if its rows are exactly the ones predicted (`StepPlan.take_next_of`);
anything else (assisted decoding accepting several tokens, a cache that must grow) plans anew.

Models split across devices (accelerate's ``device_map``) receive at each layer on another device a *copy* of the
mask, without the plan. Such a copy adopts the step's plan (`StepPlan.adoptable_by`) instead of building its own,
so each device plans once per step.
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers.masking_utils import causal_mask_function, sdpa_mask

# Query tokens per sequence up to which a forward is treated as decode (absorbed attention). One token is plain
# decoding; a few cover assisted/speculative decoding. Above it, expanding K/V once is cheaper.
MAX_DECODE_QUERY = 8

_PLAN_ATTR = "_flashinfer_mla_plan"


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask as booleans, True = attend. Additive masks (0 = attend, dtype min = masked), as ``eager`` builds
    them or a user may pass, are converted; boolean masks are returned as they are."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


@dataclass(frozen=True)
class KVRanges:
    """The cached positions ``[first[b], end)`` that the last query token of row ``b`` attends to, known on the host.

    Earlier query tokens of the same step (assisted decoding) see a prefix of it, exactly as a causal kernel
    gives them: query ``i`` of ``q_len`` ends at ``end - q_len + i``.
    """

    first: torch.Tensor  # [B] int64, on the CPU
    end: int
    first_on_device: torch.Tensor | None = None  # `first` where the mask is built; None: every row starts at 0

    def lengths(self) -> torch.Tensor:
        return (self.end - self.first).clamp(min=0)

    def mask(self, batch_size: int, q_len: int, kv_len: int, device) -> torch.Tensor:
        """The step's ``[B, 1, q_len, kv_len]`` boolean mask, equal to the one ``sdpa_mask`` builds for these rows
        (a left-padded 2D mask that only grew, under the causal mask), in a handful of ops instead of its dozens:
        position ``j`` is visible to query token ``i`` when ``first[b] <= j <= end - q_len + i``."""
        positions = torch.arange(kv_len, device=device)
        last = torch.arange(self.end - q_len, self.end, device=device)  # the last position each query token sees
        causal = positions <= last[:, None]  # [q_len, kv_len]
        if self.first_on_device is None:
            return causal.expand(batch_size, 1, q_len, kv_len).contiguous()
        return causal & (positions >= self.first_on_device.view(batch_size, 1, 1, 1))

    def same_as(self, other: KVRanges | None) -> bool:
        return other is not None and self.end == other.end and (
            self.first is other.first or torch.equal(self.first, other.first))


class StepPlan:
    """Everything the decode layers of one forward step share, on every device the model runs on."""

    def __init__(self, mask: torch.Tensor):
        if mask.dim() != 4:
            raise ValueError(f"expected a 4D attention mask [batch, 1, q_len, kv_len], got shape {tuple(mask.shape)}")
        self.source_shape, self.source_dtype = tuple(mask.shape), mask.dtype
        mask = as_bool_mask(mask)
        self.mask = mask  # [B, 1, Sq, Skv] bool, True = attend
        self.batch_size, _, self.q_len, self.kv_len = mask.shape
        self.ranges: KVRanges | None = None  # set when the rows are known on the host
        self._masks: dict[torch.device, torch.Tensor] = {mask.device: mask}
        self._states: dict[Any, Any] = {}
        self._consumers: set[int] = set()  # attention modules that ran on this plan (see `adoptable_by`)
        self._config = None  # config of the model whose layers consume it
        self._next: tuple[KVRanges, dict] | None = None  # the next step's states, planned ahead (`plan_next`)

    def mask_on(self, device: torch.device) -> torch.Tensor:
        """The mask on `device` (copied once per device and step, for models split across GPUs)."""
        if device not in self._masks:
            self._masks[device] = self.mask.to(device, non_blocking=True)
        return self._masks[device]

    def kv_valid(self, device: torch.device) -> torch.Tensor:
        """``[B, Skv]`` bool: the cached positions visible to the *last* query token of each sequence.

        With a causal kernel, earlier query tokens of the same step see a prefix of this set.
        """
        return self.mask_on(device)[:, 0, -1, :]

    def state(self, key: Any, build: Callable[[], Any]) -> Any:
        """Step metadata for `key` (the backend choice, a device's kernel metadata), built by the first layer that
        asks and shared by the others."""
        if key not in self._states:
            self._states[key] = build()
        return self._states[key]

    def plan_next(self, end: int) -> None:
        """Plan the next step now, for rows ``[first, end)``: called by generate() once it has queued this step and
        grown its 2D mask to `end`, so that the host plans while the GPU still runs this step (the host would
        otherwise plan after generate() has waited for this step's tokens).

        Every state that can (an ``ahead(ranges, q_len)`` method: `flashinfer_fa.FaStep`,
        `cuda_graphs.GraphSlot`) builds its successor. The next step's plan takes them over if its rows are the
        ones predicted, and drops them otherwise (`attach_plan`)."""
        if self.ranges is None:
            return
        ranges = KVRanges(self.ranges.first, end)
        ahead = {}
        for key, value in list(self._states.items()):
            successor = value.ahead(ranges, self.q_len) if hasattr(value, "ahead") else None
            if successor is not None:
                ahead[key] = successor
        self._next = (ranges, ahead) if ahead else None

    def take_next_of(self, previous: StepPlan) -> None:
        """Start with the states `previous` planned ahead, if they were planned for exactly this step's rows."""
        planned, previous._next = previous._next, None
        if (
            planned is not None
            and planned[0].same_as(self.ranges)
            and (previous.batch_size, previous.q_len) == (self.batch_size, self.q_len)
        ):
            self._states.update(planned[1])

    def consumed_by(self, module) -> None:
        if not self._consumers:
            self._config = module.config
        self._consumers.add(id(module))

    def adoptable_by(self, mask: torch.Tensor, module) -> bool:
        """Whether a plan-less `mask` reaching `module` is a copy of this plan's mask made for this very step.

        accelerate copies the step's mask to the device of every layer that sits on another GPU, and the copy
        carries no plan. It is taken for such a copy when it has the plan's shape and dtype, the plan is in use
        by this model (some layer of the same model already ran on it) and `module` has not run on it yet. A layer
        that already ran on the plan is at a new step: a new mask there (a user's 4D mask, a stale plan's
        successor) gets a plan of its own, never this one.
        """
        return (
            tuple(mask.shape) == self.source_shape
            and mask.dtype == self.source_dtype
            and self._config is not None
            and module.config is self._config
            and id(module) not in self._consumers
        )


# The latest plan built in this thread or task: the only plan a plan-less mask copy may adopt. (A plan built for
# a copy is referenced by nothing else, and the layers after it must still find it.)
_latest_plan: contextvars.ContextVar[StepPlan | None] = contextvars.ContextVar("flashinfer_mla_plan", default=None)


def attach_plan(mask: torch.Tensor, ranges: KVRanges | None = None) -> StepPlan:
    """Build the plan for this step's `mask` and attach it to the tensor."""
    plan = StepPlan(mask)
    plan.ranges = ranges
    previous = _latest_plan.get()
    if previous is not None and ranges is not None:
        plan.take_next_of(previous)
    setattr(mask, _PLAN_ATTR, plan)
    _latest_plan.set(plan)
    return plan


def plan_of(mask: torch.Tensor) -> StepPlan | None:
    """The plan attached to `mask`, if any."""
    return getattr(mask, _PLAN_ATTR, None)


def step_plan(mask: torch.Tensor, module) -> StepPlan:
    """The plan of the step `mask` belongs to, as seen by the attention `module`.

    Built here only for a mask that did not come from the mask function: a copy made for another device adopts
    the step's plan; anything else (a user-supplied 4D mask) gets an exact plan of its own.
    """
    plan = getattr(mask, _PLAN_ATTR, None)
    if plan is None:
        latest = _latest_plan.get()
        plan = latest if latest is not None and latest.adoptable_by(mask, module) else attach_plan(mask)
    plan.consumed_by(module)
    return plan


# --------------------------------------------------------------------------------------------------------------
# generate(): the padding of each row is fixed for the call
# --------------------------------------------------------------------------------------------------------------
@dataclass
class _GenerateCall:
    """One generate() call. `extending` becomes True at generate()'s first update of the 2D mask: from then on the
    mask only grows by ones on the right (or is cropped from the right, in assisted decoding)."""

    extending: bool = False
    padding: tuple | None = None  # (device, batch, `_left_padding`'s answer for that device and batch)


_generate_call: contextvars.ContextVar[_GenerateCall | None] = contextvars.ContextVar(
    "flashinfer_mla_generate", default=None
)


def _within_generate(generate):
    @functools.wraps(generate)
    def generate_with_fixed_padding(self, *args, **kwargs):
        token = _generate_call.set(_GenerateCall())
        _latest_plan.set(None)  # nothing planned ahead by an earlier loop of this thread is taken over
        try:
            return generate(self, *args, **kwargs)
        finally:
            _generate_call.reset(token)
            _latest_plan.set(None)  # release the last step's buffers

    generate_with_fixed_padding._flashinfer_mla_generate = True
    return generate_with_fixed_padding


def _marks_mask_extension(update):
    @functools.wraps(update)
    def update_model_kwargs(self, *args, **kwargs):
        call = _generate_call.get()
        if call is not None:
            call.extending = True
        model_kwargs = update(self, *args, **kwargs)
        plan = _latest_plan.get()
        mask = model_kwargs.get("attention_mask") if isinstance(model_kwargs, dict) else None
        if call is not None and plan is not None and isinstance(mask, torch.Tensor) and mask.dim() == 2:
            plan.plan_next(mask.shape[-1])  # this step is queued: plan the next while the GPU runs it
        return model_kwargs

    update_model_kwargs._flashinfer_mla_generate = True
    return update_model_kwargs


def install_generate_hooks() -> None:
    """Let the mask function know when it runs inside ``generate()``'s decode loop (idempotent).

    ``GenerationMixin.generate`` opens a per-call scope (a context variable: per thread and task, nested calls
    such as an assistant model's generate() get their own); ``_update_model_kwargs_for_generation`` (the function
    that appends the ones for each new token) marks the scope as extending. Until then (prefill, chunked prefill)
    and outside any generate() call, plans are derived from the mask.
    """
    from transformers.generation.utils import GenerationMixin

    if not getattr(GenerationMixin.generate, "_flashinfer_mla_generate", False):
        GenerationMixin.generate = _within_generate(GenerationMixin.generate)
    update = GenerationMixin._update_model_kwargs_for_generation
    if not getattr(update, "_flashinfer_mla_generate", False):
        GenerationMixin._update_model_kwargs_for_generation = _marks_mask_extension(update)


def _read_left_padding(padding_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(first [B] host int64, the same on the mask's device, every row is zeros then ones)`` of a 2D mask: one
    device-to-host copy."""
    valid = padding_mask.bool()
    first = valid.int().argmax(-1)
    positions = torch.arange(valid.shape[-1], device=valid.device)
    left_padded = valid.any(-1) & (valid == (positions >= first[:, None])).all(-1)
    host = torch.stack([first, left_padded.long()]).cpu()
    return host[0], first.long(), bool(host[1].all())


def _left_padding(call: _GenerateCall, padding_mask: torch.Tensor):
    """``(first on the host, max first, first on the mask's device)`` of the 2D mask if every row is zeros then
    ones, else None. Read once per generate() call (the only device sync of its decode steps), then reused."""
    device, batch = padding_mask.device, padding_mask.shape[0]
    if call.padding is None or call.padding[:2] != (device, batch):
        first, on_device, left_padded = _read_left_padding(padding_mask)
        call.padding = (device, batch, (first, int(first.max()), on_device) if left_padded else None)
    return call.padding[2]


def host_ranges(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask):
    """The step's `KVRanges` when they are known without reading the GPU, else None (plan from the mask)."""
    if mask_function is not causal_mask_function or kv_offset != 0:
        return None  # overlays (sliding windows, packed sequences, block masks): derive from the mask
    end = q_offset + q_length if isinstance(q_offset, int) else None  # a StaticCache's offset is a device tensor
    if attention_mask is None:
        if end is None or end > kv_length:
            return None
        return KVRanges(torch.zeros(batch_size, dtype=torch.long), end)
    call = _generate_call.get()
    if call is None or not call.extending or attention_mask.dim() != 2:
        return None
    width = attention_mask.shape[-1]  # generate()'s 2D mask spans the cached tokens and the new ones
    if (end is not None and end != width) or width > kv_length:
        return None
    padding = _left_padding(call, attention_mask)
    if padding is None or padding[1] >= width:
        return None
    return KVRanges(padding[0], width, padding[2])


def flashinfer_mla_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs,
) -> torch.Tensor | None:
    """The step's mask, as SDPA's boolean mask; for decode steps it is always materialised and planned.

    This is the once-per-step point: Transformers calls it once per forward (or, with a static cache, once per
    step in ``prepare_inputs_for_generation``, outside any compiled region), and the `StepPlan` attached here is
    shared by every layer. CUDA-graph slots are re-planned here, before the graph replays. Where the rows are
    known on the host (`host_ranges`) the mask is built from them (`KVRanges.mask`, the same values as
    ``sdpa_mask``'s in a few ops).
    """
    decode = q_length <= MAX_DECODE_QUERY
    compiling = torch.compiler.is_compiling()
    ranges = None
    if decode and not compiling:
        ranges = host_ranges(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask)
    device = kwargs.get("device", "cpu")
    if ranges is not None and (ranges.first_on_device is None or ranges.first_on_device.device == torch.device(device)):
        mask = ranges.mask(batch_size, q_length, kv_length, device)
    else:
        mask = sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            allow_is_causal_skip=allow_is_causal_skip and not decode,
            **kwargs,
        )
        if not decode or mask is None:
            return mask
        mask = mask.contiguous()
    from . import cuda_graphs  # (cuda_graphs imports this module)

    if compiling:
        cuda_graphs.note_mask_built_in_graph()
        return mask
    cuda_graphs.plan_graph_slots(attach_plan(mask, ranges))
    return mask
