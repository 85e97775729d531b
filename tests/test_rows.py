"""A step's rows on the host (`rows.Rows`, `rows.GrowingMask`): the rows generate()'s 2D mask carries, read once and
grown with the mask, equal the rows read off each step's mask; masks that are not left padding carry none; rows with
holes, indices beyond int32, and the refusal of a float mask that adds a bias."""

from __future__ import annotations

import pytest
import torch
from helpers import rows_on_host

from hf_flashinfer_mla.kernels import fa
from hf_flashinfer_mla.rows import GrowingMask, Rows

CPU = torch.device("cpu")


def _left_padded(b, s, g):
    first = torch.randint(0, s, (b,), generator=g)
    valid = torch.arange(s)[None, :] >= first[:, None]
    return first, valid


@pytest.mark.parametrize("seed", range(6))
def test_growing_mask_rows_equal_rows_from_mask(seed):
    """The rows generate()'s 2D mask carries (`GrowingMask`, read once, then grown with the mask) give the same CSR
    arrays and, for any pitch, the same page offsets and indices as reading the step's mask."""
    g = torch.Generator().manual_seed(seed)
    b, s = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
    q_len = 1 + seed % 4
    first, valid = _left_padded(b, s, g)
    growing = GrowingMask.read(valid.long())  # generate()'s mask: int64 zeros then ones
    assert growing.first.tolist() == first.tolist() and growing.width == s
    for width in (s, s + 3):  # as read, and grown by generate()'s next mask update
        valid = torch.cat([valid, torch.ones(b, width - valid.shape[1], dtype=torch.bool)], -1)
        ours, exact = growing.grown(width).rows(q_len, width), Rows.from_mask(valid, q_len)
        assert ours.end == width and ours.q_len == exact.q_len == q_len
        for a, e in ((ours.lens, exact.lens), (ours.first, exact.first), (ours.qo_indptr(), exact.qo_indptr()),
                     (ours.kv_indptr(), exact.kv_indptr())):
            assert a.device.type == "cpu" and a.dtype == e.dtype and torch.equal(a, e)
        assert ours.lens.dtype == torch.int32
        for pitch in (width, width + 5, 3 * width + 1):
            assert torch.equal(ours.page_offsets(pitch), exact.page_offsets(pitch))
            assert torch.equal(ours.kv_indices(pitch, CPU), exact.kv_indices(pitch, CPU))


def test_growing_mask_rows_only_where_the_mask_spans_the_cache():
    """A `GrowingMask` gives rows only when every row has a visible position and the mask fits the cache."""
    growing = GrowingMask(torch.tensor([2, 1]), torch.tensor([2, 1]), 3)
    assert growing.rows(1, 3).lens.tolist() == [1, 2] and growing.rows(1, 8).end == 3  # a static cache's tail
    assert growing.rows(1, 2) is None  # wider than the cache
    assert GrowingMask(growing.first, growing.first_on_device, 2).rows(1, 2) is None  # row 0 would be empty


@pytest.mark.parametrize("rows", [
    [[1, 0, 1, 1], [1, 1, 1, 1]],  # a hole
    [[1, 1, 0, 0], [1, 1, 1, 1]],  # right padding
    [[0, 0, 0, 0], [1, 1, 1, 1]],  # an empty row
])
def test_masks_that_are_not_left_padding_carry_no_rows(rows):
    """Only a mask whose rows are zeros then ones describes its rows by their left padding."""
    assert GrowingMask.read(torch.tensor(rows)) is None


def test_rows_with_holes_use_positions():
    valid = torch.tensor([[True, False, True, True], [False, True, True, False]])
    rows = Rows.from_mask(valid, 1)
    assert rows.first is None and rows.lens.tolist() == [3, 2]
    assert rows.kv_indices(10, valid.device).tolist() == [0, 2, 3, 11, 12]


def test_indices_beyond_int32_are_refused():
    rows = rows_on_host([0, 0, 0], 8)
    with pytest.raises(ValueError, match="int32"):
        rows.kv_indices(2**30, CPU)
    with pytest.raises(ValueError, match="int32"):
        fa.addressing(rows, 2**30, CPU)


def test_a_finite_masking_value_is_refused_for_its_bias_first():
    """A -1e4 mask over a step of 3 tokens shows every position to the kernels' rows, so it is also not causal; the
    refusal names the cause the user can act on, the mask's values."""
    valid = torch.ones(1, 6, dtype=torch.bool)
    additive = torch.zeros(1, 1, 3, 6).masked_fill(~torch.ones(3, 6, dtype=torch.bool).tril(3), -1e4)
    rows = Rows.from_mask(valid, 3, torch.ones(1, 1, 3, 6, dtype=torch.bool), additive)
    assert rows.refusal.startswith("the step's float mask adds a bias")
