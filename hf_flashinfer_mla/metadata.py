"""Per-step planning: which cached positions each sequence attends to, built once per forward step.

Transformers builds one attention mask per forward step and hands the same tensor to every layer. The mask
function registered for ``flashinfer_mla`` (``registration.py``) builds that mask as a dense boolean tensor and
attaches a `StepPlan` to it; every layer then reads the plan off the mask it receives (`step_plan`). The plan holds
what every backend shares (the mask, per-sequence KV lengths) and, per device and backend, the kernel metadata
(for FlashInfer: the paged indices and the planned wrapper) built by the first layer that needs it. The plan lives
exactly as long as the mask tensor of its step: nothing is global and nothing outlives the step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_PLAN_ATTR = "_flashinfer_mla_plan"


class StepPlan:
    """The decode metadata of one forward step, shared by all layers (and devices) of the model."""

    def __init__(self, mask: torch.Tensor):
        if mask.dim() != 4:
            raise ValueError(f"expected a 4D attention mask [batch, 1, q_len, kv_len], got shape {tuple(mask.shape)}")
        if mask.dtype != torch.bool:
            # An additive mask (0 = attend, dtype min = masked), as `eager` builds or a user may pass.
            mask = mask > torch.finfo(mask.dtype).min / 2
        self.mask = mask  # [B, 1, Sq, Skv] bool, True = attend
        self.batch_size, _, self.q_len, self.kv_len = mask.shape
        self._masks: dict[torch.device, torch.Tensor] = {mask.device: mask}
        self._states: dict[Any, Any] = {}

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
        """Backend metadata for `key` (e.g. backend, device, cache pitch), built by the first layer that asks."""
        if key not in self._states:
            self._states[key] = build()
        return self._states[key]


def attach_plan(mask: torch.Tensor) -> StepPlan:
    """Build the plan for this step's `mask` and attach it to the tensor (called by the mask function)."""
    plan = StepPlan(mask)
    setattr(mask, _PLAN_ATTR, plan)
    return plan


def step_plan(mask: torch.Tensor) -> StepPlan:
    """The plan attached to `mask`; built here only if the mask did not come from our mask function
    (a user-supplied 4D mask, or a copy made when a model is split across devices)."""
    plan = getattr(mask, _PLAN_ATTR, None)
    if plan is None:
        plan = attach_plan(mask)
    return plan
