"""CPU-testable parts of the fa2/fa3 metadata: the row view of a cache (`kernels.fa.cache_rows`, its pitch
`kernels.cache_pitch`), the page-size-1 CSR metadata of a step's rows (`rows.Rows`: what FlashInfer's public wrapper
is planned with) and the in-place addressing the generated module is planned with (`kernels.fa.addressing`)."""

from __future__ import annotations

import pytest
import torch

from hf_flashinfer_mla import MLALatentLayer
from hf_flashinfer_mla.kernels import cache_pitch
from hf_flashinfer_mla.kernels.fa import addressing, cache_rows
from hf_flashinfer_mla.plan import StepPlan
from hf_flashinfer_mla.rows import Rows

RANK, ROPE = 512, 64


def _check_rows(latent: torch.Tensor, rows: torch.Tensor, pitch: int, aliases: bool = True) -> None:
    b, _, s, d = latent.shape
    assert rows.dim() == 3 and rows.shape[1:] == (1, d)
    assert rows.shape[0] >= (b - 1) * pitch + s
    for i in range(b):
        for j in range(s):
            assert torch.equal(rows[i * pitch + j, 0], latent[i, 0, j]), (i, j)
    if aliases:  # the view aliases the cache: no copy
        assert rows.untyped_storage().data_ptr() == latent.untyped_storage().data_ptr()


@pytest.mark.parametrize("b, s, d", [(1, 5, 512), (3, 7, 512), (4, 9, 64), (2, 1, 16)])
def test_cache_rows_contiguous(b, s, d):
    g = torch.Generator().manual_seed(b * 100 + s)
    latent = torch.randn(b, 1, s, d, generator=g)
    rows, pitch = cache_rows(latent), cache_pitch(latent)
    assert pitch == s
    assert rows.shape == (b * s, 1, d)
    _check_rows(latent, rows, pitch)
    assert torch.equal(rows[:, 0], latent.reshape(-1, d))


@pytest.mark.parametrize("b, smax, s, d", [(3, 32, 7, 512), (2, 16, 16, 64), (4, 40, 1, 8), (1, 32, 5, 64)])
def test_cache_rows_static_slice(b, smax, s, d):
    g = torch.Generator().manual_seed(smax + s)
    full = torch.randn(b, 1, smax, d, generator=g)
    latent = full[:, :, :s]
    rows, pitch = cache_rows(latent), cache_pitch(latent)
    if b > 1:
        assert pitch == smax
        assert rows.shape[0] == (b - 1) * smax + s
    _check_rows(latent, rows, pitch)


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("b, steps", [(3, [5, 1, 1]), (2, [300]), (2, [256, 1]), (4, [1])])
def test_cache_rows_latent_layer_views(b, steps, packed):
    g = torch.Generator().manual_seed(sum(steps) + b)
    layer = MLALatentLayer(packed)
    kvs, rots = [], []
    for n in steps:
        kv, rot = torch.randn(b, 1, n, RANK, generator=g), torch.randn(b, 1, n, ROPE, generator=g)
        layer.update(kv, rot)
        kvs.append(kv)
        rots.append(rot)
    kv_all, rot_all = torch.cat(kvs, 2), torch.cat(rots, 2)
    capacity = layer.capacity
    rows_latent, rows_rope = (RANK + ROPE, RANK + ROPE) if packed else (RANK, ROPE)
    assert layer.keys.stride(2) == rows_latent and layer.values.stride(2) == rows_rope

    ckv, pitch = cache_rows(layer.keys), cache_pitch(layer.keys)
    kpe, kpe_pitch = cache_rows(layer.values), cache_pitch(layer.values)
    assert pitch == kpe_pitch == capacity
    assert ckv.stride() == (rows_latent, rows_latent, 1)
    assert kpe.stride() == (rows_rope, rows_rope, 1)
    _check_rows(kv_all, ckv, pitch, aliases=False)
    _check_rows(rot_all, kpe, pitch, aliases=False)
    # And against the layer's own views.
    _check_rows(layer.keys, ckv, pitch)
    _check_rows(layer.values, kpe, pitch)


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_cache_rows_latent_layer_single_sequence(packed):
    """With one sequence the pitch is never used (b * pitch == 0) but the rows still match."""
    g = torch.Generator().manual_seed(5)
    layer = MLALatentLayer(packed)
    kv, rot = torch.randn(1, 1, 9, RANK, generator=g), torch.randn(1, 1, 9, ROPE, generator=g)
    layer.update(kv, rot)
    ckv, p1 = cache_rows(layer.keys), cache_pitch(layer.keys)
    kpe, p2 = cache_rows(layer.values), cache_pitch(layer.values)
    assert p1 == p2
    _check_rows(kv, ckv, p1, aliases=False)
    _check_rows(rot, kpe, p2, aliases=False)
    _check_rows(layer.keys, ckv, p1)
    _check_rows(layer.values, kpe, p2)


def test_cache_rows_csr_indices_gather_the_valid_tokens():
    """End to end on CPU: rows[kv_indices] are exactly the valid tokens of each sequence, in order, and so are the
    rows the generated module's in-place addressing points at."""
    g = torch.Generator().manual_seed(11)
    b, smax, s, d = 3, 20, 12, 32
    full = torch.randn(b, 1, smax, d, generator=g)
    latent = full[:, :, :s]
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :4] = False  # left padding
    valid[2, 10:] = False  # unfilled tail
    rows, pitch = cache_rows(latent), cache_pitch(latent)
    _, kv_indptr, kv_indices, lens = _csr(valid, pitch, 1)
    pages = _pages(valid, pitch)
    for i in range(b):
        got = rows[kv_indices[kv_indptr[i] : kv_indptr[i + 1]].long(), 0]
        assert torch.equal(got, latent[i, 0][valid[i]])
        assert torch.equal(rows[pages[i].long(), 0], latent[i, 0][valid[i]])


def test_cache_rows_rejects_non_contiguous_last_dim():
    t = torch.randn(2, 1, 8, 16).transpose(-1, -2)
    with pytest.raises(ValueError):
        cache_rows(t)


def _brute_force(valid: torch.Tensor, pitch: int, q_len: int):
    b, s = valid.shape
    indices, indptr, lens = [], [0], []
    for i in range(b):
        n = 0
        for j in range(s):
            if bool(valid[i, j]):
                indices.append(i * pitch + j)
                n += 1
        lens.append(n)
        indptr.append(indptr[-1] + n)
    qo = [i * q_len for i in range(b + 1)]
    return qo, indptr, indices, lens


def _random_valid(g, b, s):
    """Rows with left padding, an unfilled tail, holes, all valid, or empty."""
    valid = torch.zeros(b, s, dtype=torch.bool)
    for i in range(b):
        kind = int(torch.randint(0, 5, (1,), generator=g))
        if kind == 0:
            valid[i] = True
        elif kind == 1:  # left padding
            valid[i, int(torch.randint(0, s + 1, (1,), generator=g)) :] = True
        elif kind == 2:  # filled prefix (static tail)
            valid[i, : int(torch.randint(0, s + 1, (1,), generator=g))] = True
        elif kind == 3:
            valid[i] = torch.rand(s, generator=g) < 0.5
        # kind 4: empty row
    return valid


def _csr(valid: torch.Tensor, pitch: int, q_len: int):
    """``(qo_indptr, kv_indptr, kv_indices, kv_len)`` of the rows `valid` marks, as FlashInfer's public wrapper is
    planned with them: the step's rows read off its mask (`Rows.from_mask`), compact CSR over a cache of `pitch`."""
    rows = Rows.from_mask(valid, q_len)
    return rows.qo_indptr(), rows.kv_indptr(), rows.kv_indices(pitch, valid.device), rows.lens


def _pages(valid: torch.Tensor, pitch: int) -> list[torch.Tensor]:
    """Each row's pages as the generated module reads them: ``kv_indices[kv_indptr[b] : kv_indptr[b] + kv_len[b]]``
    (its offsets need not be compact: single runs point into the identity)."""
    rows = Rows.from_mask(valid, 1)
    kv_indptr, kv_indices = addressing(rows, pitch, valid.device)
    assert kv_indptr.dtype == kv_indices.dtype == torch.int32 and kv_indptr.device.type == "cpu"
    spans = sorted(zip(kv_indptr[:-1].tolist(), (kv_indptr[:-1] + rows.lens).tolist()))
    if rows.first is None:  # rows with holes: compact CSR over explicit indices
        assert kv_indptr.tolist() == rows.kv_indptr().tolist()
    else:  # single runs: no two rows share a page (sequence b's rows lie at b * pitch + j)
        assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))
    return [kv_indices[s : s + n] for s, n in zip(kv_indptr[:-1].tolist(), rows.lens.tolist())]


@pytest.mark.parametrize("seed", range(12))
def test_csr_metadata_matches_brute_force(seed):
    """The step's CSR metadata (the public wrapper's) and the generated module's addressing both give exactly the
    pages of each row's valid positions, for left padding, unfilled tails, holes, full and empty rows."""
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 7, (1,), generator=g))
    s = int(torch.randint(1, 40, (1,), generator=g))
    pitch = s + int(torch.randint(0, 30, (1,), generator=g))
    q_len = int(torch.randint(1, 5, (1,), generator=g))
    valid = _random_valid(g, b, s)
    if seed == 0:
        valid[0] = False  # make sure an empty row and left padding are present
        valid[-1] = torch.arange(s) >= s // 2
    qo_indptr, kv_indptr, kv_indices, lens = _csr(valid, pitch, q_len)
    e_qo, e_indptr, e_indices, e_lens = _brute_force(valid, pitch, q_len)
    for t in (qo_indptr, kv_indptr, lens):
        assert t.dtype == torch.int32 and t.device.type == "cpu"  # the planner reads them on the host
    assert kv_indices.dtype == torch.int32 and kv_indices.device == valid.device
    assert qo_indptr.tolist() == e_qo
    assert kv_indptr.tolist() == e_indptr
    assert kv_indices.tolist() == e_indices
    assert lens.tolist() == e_lens
    assert kv_indices.numel() == int(kv_indptr[-1])
    pages = _pages(valid, pitch)
    assert [p.tolist() for p in pages] == [e_indices[e_indptr[i] : e_indptr[i + 1]] for i in range(b)]


def test_csr_metadata_left_padding_and_empty_rows():
    valid = torch.tensor(
        [
            [False, False, True, True, True],
            [False, False, False, False, False],
            [True, True, True, True, True],
            [True, True, False, False, False],
        ]
    )
    qo, indptr, indices, lens = _csr(valid, 8, 1)
    assert qo.tolist() == [0, 1, 2, 3, 4]
    assert lens.tolist() == [3, 0, 5, 2]
    assert indptr.tolist() == [0, 3, 3, 8, 10]
    assert indices.tolist() == [2, 3, 4, 16, 17, 18, 19, 20, 24, 25]
    assert [p.tolist() for p in _pages(valid, 8)] == [[2, 3, 4], [], [16, 17, 18, 19, 20], [24, 25]]


def test_csr_metadata_all_empty():
    valid = torch.zeros(3, 6, dtype=torch.bool)
    qo, indptr, indices, lens = _csr(valid, 6, 2)
    assert qo.tolist() == [0, 2, 4, 6]
    assert indptr.tolist() == [0, 0, 0, 0]
    assert indices.numel() == 0 and indices.dtype == torch.int32
    assert lens.tolist() == [0, 0, 0]
    assert [p.numel() for p in _pages(valid, 6)] == [0, 0, 0]


def test_csr_metadata_from_step_plan_mask():
    """What a step's builder reads: the rows of the last query row of the step's mask (`StepPlan.rows`), earlier
    query tokens seeing a prefix of them through the causal kernel."""
    s, q = 10, 3
    mask = torch.zeros(2, 1, q, s, dtype=torch.bool)
    for i in range(q):
        mask[:, 0, i, : s - q + 1 + i] = True
    mask[1, 0, :, :4] = False
    rows = StepPlan(mask).rows()
    assert rows.q_len == q and rows.first.tolist() == [0, 4]
    assert rows.qo_indptr().tolist() == [0, 3, 6]
    assert rows.lens.tolist() == [10, 6]
    assert rows.kv_indices(16, torch.device("cpu")).tolist() == list(range(10)) + list(range(16 + 4, 16 + 10))
    assert addressing(rows, 16, torch.device("cpu"))[0].tolist() == [0, 16 + 4, 32]
