"""The fa2/fa3 kernels' host side (`kernels.fa`): the row view of a cache (`kernels.fa.cache_rows`, its pitch
`kernels.cache_pitch`), the page-size-1 CSR metadata of a step's rows (`rows.Rows`: what FlashInfer's public wrapper
is planned with), the in-place addressing the generated module is planned with (`kernels.fa.addressing`), the
generated module's planning (its host scratches, FlashInfer's validator and the work-item bound that skips it), and
the public wrapper other FlashInfer releases plan through. Planning and whole models run on the fa3 stand-in
(`fake_flashinfer.py`), in float64."""

from __future__ import annotations

import pytest
pytest.importorskip("flashinfer",
                    reason="these tests check the package against FlashInfer's own host code (full install)")

import torch
from helpers import (
    VOCAB,
    assert_batch_matches_eager_alone,
    decode_logits,
    eager_alone,
    fa_layer,
    left_padded_batch,
    make_model,
    rel_err,
    route_of,
    rows_on_host,
)
from fake_flashinfer import FakeMLAModule, fake_hopper  # noqa: F401  (fixture)
from flashinfer.mla._batch_mla._backends import _fa_common
from transformers import DynamicCache

from hf_flashinfer_mla import MLALatentLayer, buffers
from hf_flashinfer_mla.kernels import cache_pitch, fa
from hf_flashinfer_mla.kernels.fa import addressing, cache_rows
from hf_flashinfer_mla.plan import StepPlan
from hf_flashinfer_mla.rows import Rows

TOL = 1e-6
REAL_SURFACE = fa.generated_surface.__wrapped__  # before `fake_hopper` replaces it
CPU, META = torch.device("cpu"), torch.device("meta")
F64 = torch.float64
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


def test_single_run_rows_plan_offsets_into_the_identity():
    """Rows that are single runs are addressed in place: the page offset of row b is b * pitch + first[b] over a
    fixed identity, and reading the identity there gives exactly the compact CSR indices of the same rows."""
    rows = rows_on_host([3, 0, 7], 9)
    kv_indptr, identity = fa.addressing(rows, 16, CPU)
    assert kv_indptr.dtype == torch.int32 and kv_indptr.tolist() == [3, 16, 39, 48]
    assert identity.numel() >= 48 and torch.equal(identity[:48], torch.arange(48, dtype=torch.int32))
    assert identity is fa.addressing(rows, 8, CPU)[1]  # one identity per device, reused
    gathered = torch.cat([identity[s : s + n] for s, n in zip(kv_indptr.tolist(), rows.lens.tolist())])
    assert torch.equal(gathered, rows.kv_indices(16, CPU))
    holes = Rows.from_mask(torch.tensor([[True, False, True, True], [False, True, True, False]]), 1)
    kv_indptr, indices = fa.addressing(holes, 10, CPU)  # not runs: compact CSR, explicit indices
    assert kv_indptr.tolist() == [0, 3, 5] and indices.tolist() == [0, 2, 3, 11, 12]


def test_plans_take_turns_on_two_host_scratches_per_module(fake_hopper):
    """The native planner's 8 MiB host scratch is allocated twice per module, not per plan (allocating pinned
    memory per step cost milliseconds of host time on the H200); plans use the two in turn, every plan gets a whole
    one, and its schedule reaches the step's workspace from there."""
    for end in (40, 41, 42):
        step = StepPlan(torch.ones(2, 1, 1, end, dtype=torch.bool, device=META), rows_on_host([0, 3], end))
        assert route_of(step, fa_layer(META)).backend == "fa3"
    plans = fake_hopper.modules["fa3"].plans
    assert [p["kv_len"].tolist() for p in plans] == [[40, 37], [41, 38], [42, 39]]
    addresses = [p["scratch"].data_ptr() for p in plans]
    assert addresses[0] == addresses[2] != addresses[1]
    assert plans[0]["scratch"].numel() == fa.INT_WORKSPACE_BYTES


def test_a_scratch_is_reused_only_after_the_gpu_read_it(fake_hopper):
    """A plan two steps ahead of the GPU waits for the copy out of its scratch; a completed copy costs no wait."""
    engine = fa.generated_fa(fa_layer(), "fa3")

    class Copy:
        def __init__(self, done):
            self.done, self.waited = done, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = True

    rows = rows_on_host([0, 3], 9)
    workspace = engine.new_workspace()
    engine.plan(rows, rows.kv_indptr(), False, workspace)
    engine.plan(rows, rows.kv_indptr(), False, workspace)
    pending, done = Copy(False), Copy(True)
    engine._scratches = [(engine._scratches[0][0], pending), (engine._scratches[1][0], done)]
    engine.plan(rows, rows.kv_indptr(), False, workspace)
    assert pending.waited and not done.waited
    engine.plan(rows, rows.kv_indptr(), False, workspace)
    assert not done.waited
    staged = workspace.view(torch.int32)
    assert staged[:2].tolist() == [2, 3] and staged[5:8].tolist() == [0, 9, 15]  # batch, plan id; kv_indptr


def _fake_wrapper(monkeypatch) -> list:
    """Replace FlashInfer's public BatchMLAPagedAttentionWrapper by a fake that checks its arguments, runs
    `FakeMLAModule` on them (its own, not the generated surface's), and records itself in the returned list when it
    is planned (each keeps its ``plans`` and ``runs``)."""
    import flashinfer.mla

    planned = []

    class Wrapper:
        def __init__(self, float_workspace_buffer, use_cuda_graph=False, *, backend):
            assert backend == "fa3" and float_workspace_buffer.dtype == torch.uint8 and not use_cuda_graph
            self.module = FakeMLAModule(backend)
            self.plans, self.runs = [], 0

        def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
                 kv_data_type, query_layout, kv_cache_layout):
            assert (page_size, query_layout, kv_cache_layout) == (1, "split", "split")
            assert q_data_type == kv_data_type == F64 and (head_dim_ckv, head_dim_kpe) == (32, 8)
            assert int(metadata.kv_indptr[-1]) == metadata.kv_indices.numel()  # compact CSR, explicit indices
            self.ws = torch.zeros(4096, dtype=torch.uint8)
            self.info, _ = self.module.plan_with_staged_workspace_bytes(
                self.ws, self.ws, torch.zeros(4096, dtype=torch.uint8), metadata.qo_indptr, metadata.kv_indptr,
                metadata.kv_len_arr, num_heads, head_dim_ckv, causal)
            self.kv_indices, self.scale, self.causal = metadata.kv_indices, sm_scale, causal
            self.plans.append(metadata)
            planned.append(self)

        def run(self, *, query, kv_cache):
            self.runs += 1
            out = torch.empty_like(query[0])
            self.module.run(self.ws, self.ws, self.info, *query, *kv_cache, self.kv_indices, out, None,
                            int(self.causal), query[0].shape[1], 1, self.scale, False, 1.0, 1.0, None)
            return out

    monkeypatch.setattr(flashinfer.mla, "BatchMLAPagedAttentionWrapper", Wrapper)
    return planned


def test_other_flashinfer_releases_use_the_public_wrapper(fake_hopper, monkeypatch):
    """The generated-module surface is private: any release other than the tested ones goes through
    BatchMLAPagedAttentionWrapper.plan/run (here a fake that checks its arguments)."""
    import flashinfer

    planned = _fake_wrapper(monkeypatch)
    assert REAL_SURFACE() is not None  # the installed release (0.7.4) is a tested one
    monkeypatch.setattr(flashinfer, "__version__", "0.7.5")
    assert REAL_SURFACE() is None
    monkeypatch.setattr(fa, "generated_surface", REAL_SURFACE)
    model = make_model("deepseek_v3")
    ids, mask, prompts = left_padded_batch()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert len(planned) == 3 and all(w.runs == model.config.num_hidden_layers for w in planned)  # one per step
    assert_batch_matches_eager_alone(model, out, prompts, 4, TOL)


@pytest.mark.parametrize("planner", ["wrapper", "direct"])
def test_planner_env_picks_the_planner(fake_hopper, monkeypatch, planner):
    """``HF_FLASHINFER_MLA_FA_PLANNER=wrapper`` makes every fa3 step plan and run through FlashInfer's public
    wrapper, even on a release whose generated module is known; any other value keeps the generated module. Either
    way the steps equal eager."""
    planned = _fake_wrapper(monkeypatch)
    monkeypatch.setenv(fa.PLANNER_ENV, planner)
    model = make_model("deepseek_v3")
    ids, mask, prompts = left_padded_batch()
    forced = torch.randint(1, VOCAB, (3, 3), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours = decode_logits(model, ids, mask, forced=forced, as_generate=True)
    layers = model.config.num_hidden_layers
    generated = fake_hopper.modules.get("fa3")
    if planner == "wrapper":
        assert len(planned) == 3 and [w.runs for w in planned] == [layers] * 3
        assert generated is None or (generated.plans == [] and generated.runs == 0)
    else:
        assert planned == [] and len(generated.plans) == 3 and generated.runs == 3 * layers
    for i, alone in enumerate(eager_alone(model, prompts, forced)):
        assert rel_err(ours[i], alone) < TOL


def test_direct_and_wrapper_planners_agree_with_the_reference(fake_hopper, monkeypatch):
    """FlashInfer's generated module planned directly (page offsets into the identity) and its public wrapper (compact
    CSR indices) must hand the kernel the same pages, lengths and mask mode for every step, decode and multi-token
    (causal) steps alike, and give the logits of the reference backend."""
    planned = _fake_wrapper(monkeypatch)
    model = make_model("deepseek_v3")
    ids, mask, _ = left_padded_batch()
    forced = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(8))
    chunks = [1, 3, 1, 1]

    def run(**kwargs):  # (Transformers' own layers: their rows move every step, so no step is planned ahead)
        with torch.no_grad():
            return decode_logits(model, ids, mask, cache=DynamicCache(), forced=forced, chunks=chunks,
                                 as_generate=True, **kwargs)

    reference = run(mla_backend="reference")
    assert fake_hopper.modules == {} and planned == []
    direct = run(mla_backend="fa3")
    monkeypatch.setenv(fa.PLANNER_ENV, "wrapper")
    wrapper = run(mla_backend="fa3")
    direct_plans = fake_hopper.modules["fa3"].plans  # one per step
    assert len(planned) == len(direct_plans) == len(chunks)
    identity = buffers.identity_rows(CPU, 1)
    for d, w in zip(direct_plans, planned):
        assert torch.equal(d["kv_len"], w.plans[0].kv_len_arr) and torch.equal(d["qo_indptr"], w.plans[0].qo_indptr)
        pages = [identity[s : s + n] for s, n in zip(d["kv_indptr"][:-1].tolist(), d["kv_len"].tolist())]
        assert torch.equal(torch.cat(pages), w.plans[0].kv_indices)
        assert d["causal"] is w.causal
    assert [d["causal"] for d in direct_plans] == [n > 1 for n in chunks]
    assert rel_err(direct, reference) < 1e-12 and rel_err(wrapper, reference) < 1e-12


def test_decode_plans_skip_flashinfers_validator_where_the_bound_proves_acceptance(fake_hopper, monkeypatch):
    """FlashInfer's Python validator walks every sequence of every plan. A non-causal plan whose work items
    (`work_items_bound`) fit the scheduler's capacity is accepted at any lengths, so it is not called for one;
    causal plans, and plans beyond the bound, are still validated."""
    engine = fa.generated_fa(fa_layer(), "fa3")
    validated = []
    monkeypatch.setattr(fake_hopper, "validate_workload", lambda *args: validated.append(args))
    engine.sms = 132
    workspace = engine.new_workspace()
    rows = rows_on_host([0, 3], 9)
    engine.plan(rows, rows.kv_indptr(), False, workspace)
    assert validated == []
    causal = rows_on_host([0, 3], 9, q_len=2)
    engine.plan(causal, causal.kv_indptr(), True, workspace)
    assert len(validated) == 1
    monkeypatch.setattr(fa, "MAX_WORK_ITEMS", 133)  # two sequences' tiles + 132 SMs exceed it
    engine.plan(rows, rows.kv_indptr(), False, workspace)
    assert len(validated) == 2
    engine.sms = None  # an SM count that is not known (not a CUDA device): always validated
    monkeypatch.setattr(fa, "MAX_WORK_ITEMS", 16384)
    engine.plan(rows, rows.kv_indptr(), False, workspace)
    assert len(validated) == 3


@pytest.mark.parametrize("heads", [1, 16, 20, 64, 128])
def test_work_items_bound_covers_flashinfers_count(heads):
    """`work_items_bound` against FlashInfer's own count of a plan's work items (`_fa_plan_work_count`, which
    mirrors its scheduler), for uneven batches of long and short sequences, decode and 2-8 token steps."""
    g = torch.Generator().manual_seed(heads)
    for batch in (1, 3, 32, 300):
        for q_len in (1, 2, 8):
            for scale in (10, 5000, 300000):
                kv = (torch.rand(batch, generator=g) * scale).long().clamp(min=q_len).tolist()
                for causal in (False, True):
                    count = _fa_common._fa_plan_work_count([q_len] * batch, kv, heads, 132, causal)
                    assert count <= fa.work_items_bound(batch, q_len, heads, 132), (batch, q_len, kv)
