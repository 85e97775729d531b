"""Sparse MLA (DSA) decode on a real GPU: FlashInfer's fa3/fa2 over the indexer's selection, against the float64
reference on the same indices, and a DeepSeek-V3.2-shaped model against Transformers' eager (bf16).

Without CUDA the same tests run on the CPU stand-ins (``gpu_suite.py``). Where the decode path is observed or
faulted: ``kernels.fa.run`` (every fa2/fa3 launch, with the layer's indices). The model-level bounds are checked to
be discriminating: the same comparison with each query token's selection swapped for its most recent positions must
fail them, and the control asserts that every decode layer of every step ran with the fault.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from gpu_suite import CUDA, DEV, DTYPE, RANK, ROPE, ROUNDING, sized
from hf_flashinfer_mla import capabilities
from hf_flashinfer_mla.kernels import fa, reference
from hf_flashinfer_mla.plan import StepPlan, decode_latent
from hf_flashinfer_mla.rows import Rows
from test_gpu_backends import Bounds
from test_gpu_backends import _teacher_forced as backends_teacher_forced

KERNELS = ["fa3", "fa2"]
KERNEL_TOL = 2e-2 if CUDA else ROUNDING  # bf16 operands against the float64 reference


def _available(backend, heads=128):
    reason = capabilities.unavailable_reason(backend, DEV, DTYPE, RANK, ROPE, heads)
    if reason:
        pytest.skip(f"{backend}: {reason}")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _indexer_like(mask, topk, g):
    """Indices as Transformers' indexers return them: top-k of random scores with the hidden positions at -inf
    (so a row that sees fewer than topk positions ends with hidden ones)."""
    scores = torch.rand(mask.shape[0], mask.shape[2], mask.shape[3], device=DEV, generator=g)
    scores = scores.masked_fill(~mask[:, 0], float("-inf"))
    return scores.topk(min(topk, mask.shape[3]), dim=-1).indices.to(torch.int32)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("heads,q_len", [(128, 1), (64, 1), (16, 2)])
def test_sparse_kernel_matches_float64_reference(backend, heads, q_len):
    """Rows shorter than topk (their tail indices point at hidden positions), longer ones, left padding and a
    static tail holding garbage, a latent view with a pitch (capacity) beyond its length."""
    _available(backend, heads)
    g = torch.Generator(device=DEV).manual_seed(0)
    topk, lens, pad, cap = 2048, (300, 2047, 2600, 5000), (0, 7, 64, 1), 5200
    b, s = len(lens), max(p + n for p, n in zip(pad, lens))
    kv = torch.randn(b, 1, cap, RANK, device=DEV, dtype=DTYPE, generator=g)[:, :, :s]
    kr = torch.randn(b, 1, cap, ROPE, device=DEV, dtype=DTYPE, generator=g)[:, :, :s]
    mask = torch.zeros(b, 1, q_len, s, dtype=torch.bool, device=DEV)
    for i, (p, n) in enumerate(zip(pad, lens)):
        mask[i, 0, :, p:p + n] = True
        mask[i, 0] &= torch.ones(q_len, s, dtype=torch.bool, device=DEV).tril(p + n - q_len)
        kv[i, :, :p] = 1e4  # garbage where the mask hides
        kv[i, :, p + n:] = 1e4
    indices = _indexer_like(mask, topk, g)
    q_lat = torch.randn(b, heads, q_len, RANK, device=DEV, dtype=DTYPE, generator=g) * 0.05
    q_pe = torch.randn(b, heads, q_len, ROPE, device=DEV, dtype=DTYPE, generator=g) * 0.05
    rows = Rows(torch.tensor([p + n for p, n in zip(pad, lens)], dtype=torch.int32) - torch.tensor(pad,
                dtype=torch.int32), q_len, torch.tensor(pad))
    step = StepPlan(mask, rows)
    ours = decode_latent(step, backend, q_lat, q_pe, kv, kr, 0.07, indices=indices)
    assert [route.backend for route in step.routes.values()] == [backend]
    h, n = heads, b * q_len
    oracle = reference.attend_sparse(
        mask, indices, 0.07, q_lat.double().transpose(0, 1).reshape(h, n, RANK),
        q_pe.double().transpose(1, 2).reshape(n, h, ROPE), kv.double(), kr.double(),
    ).view(h, b, q_len, RANK).transpose(0, 1)
    err = rel(ours, oracle)
    print(f"sparse {backend} heads {heads} q_len {q_len}: rel err {err:.2e}")
    assert torch.isfinite(ours).all() and err < KERNEL_TOL


# ---------------------------------------------------------------- a DeepSeek-V3.2-shaped model
def _v32_model():
    """DeepSeek-V3.2's attention and indexer dims (128 heads, 512 + 64 latent, 64 indexer heads of 128), two dense
    layers, and an index_topk of 48 so that the selection matters at these contexts (37 to 128 tokens)."""
    cfg = transformers.DeepseekV32Config(**sized(
        vocab_size=4096, hidden_size=7168, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=48, first_k_dense_replace=2, n_group=1,
        topk_group=1, max_position_embeddings=8192, initializer_range=0.05, eos_token_id=None, pad_token_id=0,
    ))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=DTYPE).to(DEV).eval()


def _teacher_forced(model, **kwargs):
    """tests/gpu/test_gpu_backends.py's 64 teacher-forced steps over its left-padded batch (37, 20, 64, 5)."""
    return backends_teacher_forced(model, DynamicCache(config=model.config), **kwargs)


def _compare(ours, oracle):
    return rel(ours, oracle), (ours.argmax(-1) == oracle.argmax(-1)).float().mean().item()


@pytest.fixture(scope="module")
def v32():
    model = _v32_model()
    eager = _teacher_forced(model)
    model.set_attn_implementation("flashinfer_mla")
    reference_logits = _teacher_forced(model, mla_backend="reference")
    # The yardstick (tests/gpu/test_gpu_backends.py): the reference's distance to eager on these inputs, this run.
    bounds = Bounds.around(*_compare(reference_logits, eager), positions=eager.shape[0] * eager.shape[1])
    print(f"v3.2 bounds: {bounds}")
    yield model, eager, reference_logits, bounds
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("backend", KERNELS)
def test_v32_teacher_forced_64_steps_match_eager_and_reference(v32, backend, monkeypatch):
    _available(backend)
    model, eager, reference_logits, bounds = v32
    launches = []
    real_run = fa.run

    def counted(meta, layer, *args, **kwargs):
        launches.append(layer.topk)
        return real_run(meta, layer, *args, **kwargs)

    monkeypatch.setattr(fa, "run", counted)
    ours = _teacher_forced(model, mla_backend=backend)
    assert launches == [48] * (64 * model.config.num_hidden_layers)  # every decode layer ran sparse on the kernel
    err_e, top1_e = _compare(ours, eager)
    err_r, top1_r = _compare(ours, reference_logits)
    ref_e, ref_top1 = _compare(reference_logits, eager)
    print(f"v3.2 {backend}: vs eager rel {err_e:.2e} top1 {top1_e:.3f} | vs reference rel {err_r:.2e} top1 "
          f"{top1_r:.3f} | reference vs eager rel {ref_e:.2e} top1 {ref_top1:.3f}")
    assert torch.isfinite(ours).all()
    assert bounds.holds(err_e, top1_e), f"vs eager: {bounds}"
    assert bounds.holds(err_r, top1_r), f"vs reference: {bounds}"


def test_v32_bounds_catch_a_wrong_selection(v32, monkeypatch):
    """Each query token attending to its most recent `topk` visible positions instead of the indexer's choice must
    fail the bounds above; injected at every fa2/fa3 launch, and the control checks it ran there."""
    backend = "fa3" if capabilities.unavailable_reason("fa3", DEV, DTYPE, RANK, ROPE, 128) is None else "fa2"
    _available(backend)
    model, eager, _, bounds = v32
    faulted = []
    real_run = fa.run

    def recent_instead(meta, layer, q_lat, q_pe, kv_latent, k_rot, kv_scales=None, indices=None):
        faulted.append(indices.shape)
        end = kv_latent.shape[2]
        recent = torch.arange(end - layer.topk, end, device=indices.device, dtype=torch.int32).flip(0)
        return real_run(meta, layer, q_lat, q_pe, kv_latent, k_rot, kv_scales, recent.expand_as(indices).contiguous())

    monkeypatch.setattr(fa, "run", recent_instead)
    wrong = _compare(_teacher_forced(model, mla_backend=backend), eager)
    assert len(faulted) == 64 * model.config.num_hidden_layers
    print(f"v3.2 control (most recent positions instead of the selection): rel {wrong[0]:.2e} top1 {wrong[1]:.3f}")
    assert not bounds.holds(*wrong)


def test_index_scores_kernel_matches_the_pytorch_path():
    """The indexer's scores over each token's own paged rows (``kernels/index_scores.py``) at DeepSeek-V3.2's
    indexer shape (64 heads of 128, bf16): the Triton kernel on CUDA against the same math in PyTorch, on a graph's
    padded decode step (tokens of one row among tokens of thousands, lengths ending mid-block, keys strided as the
    paged cache holds them) and on a prefill chunk's causal rows. The scores agree to float32 rounding of their
    sums; their top-2048 sets agree but for near-ties. Without CUDA (or Triton) both calls take the PyTorch path."""
    from hf_flashinfer_mla.kernels import index_scores

    g = torch.Generator(device=DEV).manual_seed(0)
    n, d = 40000, 128
    keys = torch.randn(n, 5 * d, device=DEV, generator=g).to(torch.bfloat16)[:, 2 * d : 3 * d]
    rows = torch.randperm(n, device=DEV, generator=g)
    decode = torch.tensor([5000, 1, 8191, 2047, 1, 300, 16384, 1], device=DEV)
    chunk = torch.arange(600, 1112, device=DEV)  # a 512-token chunk after 600 cached rows
    for lens, first, width in ((decode, torch.arange(8, device=DEV) * 2000, 16384),
                               (chunk, torch.full_like(chunk, 7000), 1111)):
        t = lens.numel()
        q = torch.randn(t, 64, d, device=DEV, generator=g).to(torch.bfloat16)
        w = torch.randn(t, 64, device=DEV, generator=g) / 8
        got = index_scores.scores(q, w, keys, rows, first, lens, width, d**-0.5)
        want = index_scores.scores(q, w, keys, rows, first, lens, width, d**-0.5, kernel=False)
        seen = torch.arange(width, device=DEV) < lens[:, None]
        assert torch.equal(got.isfinite(), seen) and torch.equal(want.isfinite(), seen)
        assert (got[seen] - want[seen]).abs().max().item() <= 1e-5 * want[seen].abs().max().item()
        k = min(2048, width)
        a, b = got.topk(k, dim=-1).indices, want.topk(k, dim=-1).indices
        same = torch.stack([torch.isin(a[i], b[i]).float().mean() for i in range(t)])
        assert same.min().item() >= 0.99, same
    if CUDA and index_scores.triton is not None:
        assert index_scores.kernel_serves(q, keys)
