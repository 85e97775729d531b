"""Which cached positions each sequence of a decode step attends to, as host arrays: the one input every kernel's
metadata is built from.

A kernel's planner (FlashInfer's scheduler, trtllm-gen's block tables) needs each sequence's visible rows on the
host. Reading them off the step's mask costs a device-to-host copy, a sync that stalls the host until the GPU has
caught up (`Rows.from_mask`). Inside ``generate()`` the sync is not needed: after the prompt, Transformers only
appends ones to the 2D padding mask, so a row's visible positions are ``[first_b, W)``, with ``first_b`` (its
left padding) fixed for the call and ``W`` (the mask's width) a host integer. `GrowingMask` records that on the 2D
mask it describes, and ``generate()``'s mask update hands it on to the next, wider mask (``generation.py``);
any other mask (a loop of the user's own, a logits processor's second model, classifier-free guidance's own
forward) carries none and is read exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask as booleans, True = attend. Additive masks (0 = attend, dtype min = masked), as ``eager`` builds
    them or a user may pass, are converted (any value above half the dtype's minimum counts as shown: a finite
    masking value such as -1e4 too, which only its bias then masks, see `Rows.refusal`); boolean masks are returned
    as they are."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def single_runs(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(first, lens, one_run)`` per row of ``valid [B, S]`` (device tensors, no sync): a row is one run when its
    valid positions are ``[first, first + lens)`` (an empty row is one run of length 0, starting at 0)."""
    lens = valid.sum(-1, dtype=torch.int32)
    first = valid.int().argmax(-1)  # 0 for an empty row
    last = valid.shape[-1] - 1 - valid.flip(-1).int().argmax(-1)
    return first, lens, (lens == 0) | (last - first + 1 == lens)


@dataclass(eq=False)
class Rows:
    """The visible rows of the *last* query token of each sequence, on the host; earlier query tokens of the same
    step (assisted decoding) see a prefix of it, as a causal kernel gives them. Rows read off a mask no kernel can
    express carry the `refusal` that says why: a mask whose earlier query tokens see anything else (a right-padded
    chunk: its padding tokens come last), one per head, or an additive mask that adds other values than 0 to the
    scores it shows (an ALiBi-like bias, or a finite masking value such as -1e4), which only the reference adds.

    Single-run rows (every mask Transformers builds) are ``[first[b], first[b] + lens[b])``; a mask with holes keeps
    its positions on the device (`positions`), and `first` is None."""

    lens: torch.Tensor  # [B] int32, host
    q_len: int
    first: torch.Tensor | None  # [B] int64, host
    positions: tuple[torch.Tensor, torch.Tensor] | None = None  # (row, position), on the mask's device
    end: int | None = None  # the common end of every row, when they came from a `GrowingMask`
    refusal: str | None = None  # why no kernel can serve these rows (`kernels.refuse_inexpressible`)

    @classmethod
    def from_mask(cls, valid: torch.Tensor, q_len: int, mask: torch.Tensor | None = None,
                  additive: torch.Tensor | None = None) -> Rows:
        """The rows marked in ``valid [B, S]`` (the last query token's): one device-to-host copy of ``5 B`` values
        (a second, ``nonzero``, only for a mask with holes). `mask` ``[B, 1, q_len, S]``: the step's whole boolean
        mask, checked for what a kernel cannot express (see `refusal`); `additive`: the mask as the model passed
        it, when that was a float mask, checked for a bias."""
        first, lens, one_run = single_runs(valid)
        checks = {}  # refusal -> [B] bool, True where a row passes (the first failed is named)
        if additive is not None:
            checks["the step's float mask adds a bias to the scores it shows (an ALiBi-like bias, or a finite "
                   "masking value)"] = ~((additive != 0) & as_bool_mask(additive)).flatten(1).any(-1)
        if mask is not None and q_len > 1:  # token i: the last one's positions but the last q_len - 1 - i
            rank = valid.int().cumsum(-1) - 1
            keep = lens[:, None] - torch.arange(q_len - 1, -1, -1, dtype=torch.int32, device=valid.device)
            checks["the step's mask is not causal within the step (right padding, or a tree of drafts?)"] = (
                (valid[:, None, :] & (rank[:, None, :] < keep[:, :, None])) == mask[:, 0]).flatten(1).all(-1)
        host = torch.stack([lens, first.int(), one_run.int(), *(c.int() for c in checks.values())]).cpu()  # the sync
        failed = [reason for reason, passed in zip(checks, host[3:]) if not bool(passed.all())]
        if mask is not None and mask.shape[1] != 1:
            failed.insert(0, "the step's mask has a row per head")
        refusal = failed[0] if failed else None
        if bool(host[2].all()):
            return cls(host[0].clone(), q_len, host[1].long(), refusal=refusal)
        return cls(host[0].clone(), q_len, None, valid.nonzero(as_tuple=True), refusal=refusal)

    @property
    def batch(self) -> int:
        return self.lens.numel()

    def qo_indptr(self) -> torch.Tensor:
        return torch.arange(self.batch + 1, dtype=torch.int32) * self.q_len

    def kv_indptr(self) -> torch.Tensor:
        """``[B + 1]`` int32 compact CSR offsets."""
        indptr = torch.zeros(self.batch + 1, dtype=torch.int32)
        indptr[1:] = self.lens.cumsum(0)
        return indptr

    def page_offsets(self, pitch: int) -> torch.Tensor:
        """``[B + 1]`` int32 offsets of each sequence's rows in a cache whose sequences lie `pitch` rows apart:
        ``b * pitch + first[b]`` (addressed through an identity page table), compact CSR offsets for rows with
        holes (addressed through `kv_indices`)."""
        if self.first is None:
            return self.kv_indptr()
        check_int32(self.batch * pitch, self.batch, pitch)
        offsets = torch.empty(self.batch + 1, dtype=torch.int32)
        offsets[:-1] = torch.arange(self.batch, dtype=torch.long) * pitch + self.first
        offsets[-1] = self.batch * pitch
        return offsets

    def kv_indices(self, pitch: int, device: torch.device) -> torch.Tensor:
        """``[total]`` int32 row indices on `device` in the compact CSR order (device arithmetic on a copy of ``2 B``
        host values: no sync)."""
        if self.first is None:
            row, pos = self.positions
            return (row * pitch + pos).to(device=device, dtype=torch.int32)
        starts = torch.arange(self.batch, dtype=torch.long) * pitch + self.first
        if self.batch:
            check_int32(int((starts + self.lens).max()), self.batch, pitch)
        host = torch.stack([starts - self.kv_indptr()[:-1], self.lens.long()]).to(torch.int32)
        offsets, lens = to_device(host, device)
        total = int(self.lens.sum())
        steps = torch.arange(total, dtype=torch.int32, device=device)
        return steps + torch.repeat_interleave(offsets, lens, output_size=total)


    def token_rows(self, topk: int) -> Rows:
        """The rows of a sparse (DSA) step, one per query token (``n = b * q_len + s``): each attends to at most
        `topk` of the positions it sees, which for token ``s`` are the last token's minus the ``q_len - 1 - s``
        later query tokens. The indexer ranks positions its mask hides last, so these are a row's first
        ``lens[n]`` indices."""
        visible = self.lens[:, None] - torch.arange(self.q_len - 1, -1, -1, dtype=torch.int32)
        return Rows(visible.clamp(0, topk).reshape(-1).to(torch.int32), 1, None)


@dataclass(eq=False)
class PageTable:
    """Where the requests of a continuous-batching step keep their rows: request ``r``'s rows are ``indices[offsets[r]
    : offsets[r] + lens[r]]`` (host offsets, the step's read indices on the device) in a layer's view of the paged
    cache, whose pages of `page_rows` rows store the latent packed (0: not packed). A step's decode requests need
    not be adjacent in it: ``offsets`` are not compact."""

    offsets: torch.Tensor  # [B] int64, host
    indices: torch.Tensor  # [end] the step's read indices, on the device
    end: int  # rows of the whole table
    page_rows: int = 0
    _typed: dict = field(default_factory=dict)

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The read indices in `dtype` (int32 for FlashInfer), converted once per step."""
        if dtype not in self._typed:
            self._typed[dtype] = self.indices[: self.end].to(dtype)
        return self._typed[dtype]

    def indptr(self) -> torch.Tensor:
        """``[B + 1]`` int32 page offsets (not compact: FlashInfer's generated module takes any, ``kernels/fa.py``)."""
        return torch.cat([self.offsets, torch.tensor([self.end])]).to(torch.int32)

    def gather(self, lens: torch.Tensor, device: torch.device, compact: bool = False):
        """Each request's rows: ``compact``, in one run ``[sum(lens)]`` (FlashInfer's public wrapper takes compact
        offsets), else ``[B, max(lens)]`` padded with the request's first row, with the mask of its real rows
        ``[B, 1, 1, max(lens)]`` (the reference)."""
        lens = lens.long()
        width = int(lens.max()) if lens.numel() else 0
        positions = torch.arange(width)
        mask = positions < lens[:, None]
        index = torch.where(mask, self.offsets[:, None] + positions, self.offsets[:, None])
        table = self.typed(torch.int32 if compact else torch.long)
        if compact:
            return table[to_device(index[mask], device)]
        return table[to_device(index, device)], to_device(mask[:, None, None], device)


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


def check_int32(rows: int, batch: int, pitch: int) -> None:
    if rows >= 2**31:
        raise ValueError(f"a cache of {batch} x {pitch} rows exceeds the kernels' int32 page indices")


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to `device` without blocking the host (through pinned memory on CUDA)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass(eq=False)
class GrowingMask:
    """The left padding of a 2D mask that only grows on the right, as ``generate()`` grows it: row ``b``'s valid
    positions are ``[first[b], width)``. Attached to the mask tensor it describes (`of`, `attach`).

    It also carries what the step over this mask planned ahead for the next one: `last_plan` is the latest step
    planned over it, and `next_step` the next step's mask and plan, ready for the mask function if it is asked
    for exactly that step (``plan.StepPlan.plan_next``).
    """

    first: torch.Tensor  # [B] int64, host
    first_on_device: torch.Tensor  # the same, where the mask lives
    width: int
    last_plan: Any = None
    next_step: tuple | None = None  # ((batch, q_len, kv_len, device, config), 4D mask, its plan)
    # Per device, [B, 1, 1, capacity] int32: position j where j >= first[b], else past every mask (see `mask`).
    # Shared by the grown masks of one generate() call, whose rows all start there.
    _visible_from: dict = field(default_factory=dict)

    ATTR = "_flashinfer_mla_rows"

    # A copied 2D mask (``copy.deepcopy``, pickling) carries no record: what it planned ahead belongs to the
    # original, and the copy is read exactly (`read`) when a step runs on it.
    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return type(None), ()

    @classmethod
    def read(cls, mask: torch.Tensor) -> GrowingMask | None:
        """The left padding of a 2D mask whose every row is zeros then ones (one sync), else None."""
        first, lens, one_run = single_runs(mask.bool())
        ends_at_width = (first.long() + lens) == mask.shape[-1]
        host = torch.stack([first.long(), (one_run & ends_at_width & (lens > 0)).long()]).cpu()
        if not bool(host[1].all()):
            return None
        return cls(host[0], first.long(), mask.shape[-1])

    @classmethod
    def of(cls, mask) -> GrowingMask | None:
        """The record attached to `mask`, unless the mask was written in place since (its version counter moved:
        the record may no longer describe it, and the mask is then read exactly). Inference-mode tensors keep no
        version counter: for those an in-place write goes unseen."""
        held = getattr(mask, cls.ATTR, None)
        return held[0] if held is not None and held[1] == _version(mask) else None

    def attach(self, mask: torch.Tensor) -> None:
        setattr(mask, self.ATTR, (self, _version(mask)))

    def grown(self, width: int) -> GrowingMask:
        """The same rows, grown to `width` (the next mask ``generate()`` builds)."""
        return GrowingMask(self.first, self.first_on_device, width, _visible_from=self._visible_from)

    def take_next(self, key: tuple):
        """``(mask, plan)`` of the step planned ahead over this mask, if it is the step `key` describes."""
        ready, self.next_step = self.next_step, None
        return ready[1:] if ready is not None and ready[0] == key else None

    def rows(self, q_len: int, kv_len: int) -> Rows | None:
        """The step's rows when this mask spans the cache (width <= the cache's length), else None."""
        if self.width > kv_len or int(self.first.max()) >= self.width:
            return None
        return Rows((self.width - self.first).to(torch.int32), q_len, self.first, end=self.width)

    def mask(self, batch_size: int, q_len: int, kv_len: int, device) -> torch.Tensor:
        """The step's ``[B, 1, q_len, kv_len]`` boolean mask, equal to ``sdpa_mask``'s for these rows under the
        causal mask: position ``j`` is visible to query token ``i`` when ``first[b] <= j <= width - q_len + i``.
        One comparison per step (``sdpa_mask`` takes dozens of ops, and each op costs the host more than the GPU):
        the left bound is folded once per call into a table of the positions, which the later steps compare with
        their right bound. The table grows by half when a dynamic cache outgrows it."""
        table = self._visible_from.get(device)
        if table is None or table.shape[-1] < kv_len:
            capacity = kv_len if table is None else max(kv_len, table.shape[-1] * 3 // 2)
            j = torch.arange(capacity, dtype=torch.int32, device=device)
            first = self.first_on_device.to(device).view(batch_size, 1, 1, 1)
            table = self._visible_from[device] = torch.where(j >= first, j, torch.iinfo(torch.int32).max)
        table = table[..., :kv_len]
        if q_len == 1:
            return table < self.width
        last = torch.arange(self.width - q_len, self.width, dtype=torch.int32, device=device)
        return table <= last.view(1, 1, q_len, 1)
