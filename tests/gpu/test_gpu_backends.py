"""FlashInfer MLA kernels on a real GPU, against the reference backend and Transformers' eager (bf16).

Skipped without CUDA. Run on the H200 with ``python -m pytest -q tests/gpu -s`` (``-s`` prints the error table).
The bounds are checked to be discriminating: the same comparison with a deliberately wrong softmax scale or a
mask that leaks padding must fail them (`test_bounds_catch_wrong_scale_and_mask`).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache, StaticCache

import hf_flashinfer_mla
from hf_flashinfer_mla import dispatch, flashinfer_fa
from hf_flashinfer_mla.attention import decode_latent
from hf_flashinfer_mla.metadata import StepPlan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = torch.device("cuda")
KERNELS = ["fa3", "fa2"]
KERNEL_TOL = 2e-2  # bf16 operands: ~3e-3 observed for a correct kernel
LOGIT_TOL = 5e-2  # relative error of the logits of a whole (few-layer) bf16 model
TOP1_MIN = 0.90  # bf16 with random weights has near-tied logits: eager vs reference agree on ~0.94


def _available(backend):
    reason = dispatch.unavailable_reason(backend, DEV, torch.bfloat16, 512, 64, 16)
    if reason:
        pytest.skip(f"{backend}: {reason}")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---------------------------------------------------------------- kernel level
def _latent_case(b, h, s, left_pad, static_tail, seed=0, packed=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    cap = s + static_tail
    if packed:
        layer = hf_flashinfer_mla.MLALatentLayer()
        layer.update(torch.randn(b, 1, s, 512, device=DEV, dtype=torch.bfloat16, generator=g),
                     torch.randn(b, 1, s, 64, device=DEV, dtype=torch.bfloat16, generator=g))
        kv, kr = layer.keys, layer.values
    else:
        kv = torch.randn(b, 1, cap, 512, device=DEV, dtype=torch.bfloat16, generator=g)[:, :, :cap]
        kr = torch.randn(b, 1, cap, 64, device=DEV, dtype=torch.bfloat16, generator=g)[:, :, :cap]
    mask = torch.ones(b, 1, 1, kv.shape[2], dtype=torch.bool, device=DEV)
    for i, p in enumerate(left_pad):
        mask[i, ..., :p] = False
    if static_tail and not packed:
        mask[..., s:] = False  # the static cache's unfilled tail
        kv[:, :, s:] = 1e4  # garbage in the unfilled tail, which must be skipped
        kr[:, :, s:] = 1e4
    for i, p in enumerate(left_pad):
        kv[i, :, :p] = 1e4  # padding garbage that must be skipped
    q_lat = torch.randn(b, h, 1, 512, device=DEV, dtype=torch.bfloat16, generator=g) * 0.05
    q_pe = torch.randn(b, h, 1, 64, device=DEV, dtype=torch.bfloat16, generator=g) * 0.05
    return q_lat, q_pe, kv, kr, mask


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("layout", ["dynamic", "static", "packed"])
def test_kernel_matches_reference(backend, heads, layout):
    _available(backend)
    q_lat, q_pe, kv, kr, mask = _latent_case(
        4, heads, 300, left_pad=[0, 17, 64, 299], static_tail=37 if layout == "static" else 0,
        packed=layout == "packed",
    )
    plan = StepPlan(mask)
    scale = 192**-0.5
    ref = decode_latent("reference", plan, q_lat.double(), q_pe.double(), kv.double(), kr.double(), scale)
    out = decode_latent(backend, plan, q_lat, q_pe, kv, kr, scale)
    err = rel(out, ref)
    print(f"kernel {backend} H={heads} {layout}: rel err {err:.2e}")
    assert torch.isfinite(out).all()
    assert err < KERNEL_TOL


# ---------------------------------------------------------------- model level
SHAPES = {
    # DeepSeek-V2-Lite attention: 16 heads, no q_lora. Two layers (one dense, one MoE), random weights.
    "v2-lite": ("DeepseekV2Config", dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                                         q_lora_rank=None, intermediate_size=4096, moe_intermediate_size=512,
                                         n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                         first_k_dense_replace=1, n_group=1, topk_group=1)),
    # DeepSeek-V3 attention: 128 heads, q_lora 1536, YaRN. Two dense layers.
    "v3": ("DeepseekV3Config", dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                                    q_lora_rank=1536, intermediate_size=2048, first_k_dense_replace=2,
                                    n_group=1, topk_group=1, rope_interleave=True,
                                    rope_scaling={"type": "yarn", "factor": 40.0,
                                                  "original_max_position_embeddings": 4096, "beta_fast": 32,
                                                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
}


def _model(shape):
    cls, kw = SHAPES[shape]
    cfg = getattr(transformers, cls)(vocab_size=4096, num_hidden_layers=2, kv_lora_rank=512, qk_rope_head_dim=64,
                                     qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=8192,
                                     initializer_range=0.05, eos_token_id=None, pad_token_id=0, **kw)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                         dtype=torch.bfloat16).to(DEV).eval()


def _prompts(lengths=(37, 20, 64, 5)):
    g = torch.Generator().manual_seed(1)
    w = max(lengths)
    ids = torch.zeros(len(lengths), w, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, w - n:] = torch.randint(1, 4096, (n,), generator=g)
        mask[i, w - n:] = 1
    forced = torch.randint(1, 4096, (len(lengths), 64), generator=g)
    return ids.to(DEV), mask.to(DEV), forced.to(DEV)


@torch.no_grad()
def _teacher_forced(model, cache, **kwargs):
    ids, mask, forced = _prompts()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    logits = []
    for t in range(forced.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=forced[:, t:t + 1], attention_mask=mask, position_ids=pos, cache=out.cache,
                    use_cache=True, **kwargs)
        logits.append(out.logits[:, -1].float())
    return torch.stack(logits, 1)


def _cache(kind, model):
    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=64 + 64 + 16)
    if kind == "latent":
        return hf_flashinfer_mla.MLALatentCache(config=model.config)
    return DynamicCache(config=model.config)


def _compare(ours, oracle):
    top1 = (ours.argmax(-1) == oracle.argmax(-1)).float().mean().item()
    return rel(ours, oracle), top1


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request):
    model = _model(request.param)
    eager = _teacher_forced(model, DynamicCache(config=model.config))
    model.set_attn_implementation("flashinfer_mla")
    reference = _teacher_forced(model, DynamicCache(config=model.config), mla_backend="reference")
    yield request.param, model, eager, reference
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("cache_kind", ["dynamic", "static", "latent"])
def test_teacher_forced_64_steps_match_eager_and_reference(shaped, backend, cache_kind):
    _available(backend)
    name, model, eager, reference = shaped
    ours = _teacher_forced(model, _cache(cache_kind, model), mla_backend=backend)
    err_e, top1_e = _compare(ours, eager)
    err_r, top1_r = _compare(ours, reference)
    ref_e, ref_top1 = _compare(reference, eager)
    print(f"{name} {backend} {cache_kind}: vs eager rel {err_e:.2e} top1 {top1_e:.3f} | vs reference rel "
          f"{err_r:.2e} top1 {top1_r:.3f} | reference vs eager rel {ref_e:.2e} top1 {ref_top1:.3f}")
    assert torch.isfinite(ours).all()
    assert err_e < LOGIT_TOL and top1_e >= TOP1_MIN
    assert err_r < LOGIT_TOL and top1_r >= TOP1_MIN


def test_bounds_catch_wrong_scale_and_mask(shaped, monkeypatch):
    """A kernel fed a 10% wrong scale, or a plan that leaks the left padding, must fail the bounds above."""
    backend = "fa3" if dispatch.unavailable_reason("fa3", DEV, torch.bfloat16, 512, 64, 16) is None else "fa2"
    _available(backend)
    name, model, eager, _ = shaped
    real_fa_decode = flashinfer_fa.fa_decode
    monkeypatch.setattr(flashinfer_fa, "fa_decode",
                        lambda b, plan, ql, qp, kv, kr, scale: real_fa_decode(b, plan, ql, qp, kv, kr, scale * 1.1))
    wrong_scale = _compare(_teacher_forced(model, DynamicCache(config=model.config), mla_backend=backend), eager)
    monkeypatch.setattr(flashinfer_fa, "fa_decode", real_fa_decode)
    real_valid = StepPlan.kv_valid
    monkeypatch.setattr(StepPlan, "kv_valid", lambda self, d: torch.ones_like(real_valid(self, d)))
    leaky_mask = _compare(_teacher_forced(model, DynamicCache(config=model.config), mla_backend=backend), eager)
    print(f"{name} controls: wrong scale rel {wrong_scale[0]:.2e} top1 {wrong_scale[1]:.3f}; "
          f"leaky mask rel {leaky_mask[0]:.2e} top1 {leaky_mask[1]:.3f}")
    for err, top1 in (wrong_scale, leaky_mask):
        assert err >= LOGIT_TOL or top1 < TOP1_MIN


# ---------------------------------------------------------------- CUDA graphs
@torch.no_grad()
def _teacher_forced_static(model, forward):
    """64 teacher-forced decode steps over a StaticCache, driven as generate() drives a compiled decode step: the
    4D mask (and with it flashinfer_mla's planning) is built eagerly each step, then `forward` runs."""
    from transformers.masking_utils import create_masks_for_generate

    ids, mask, forced = _prompts()
    cache = StaticCache(config=model.config, max_cache_len=64 + 64 + 16)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    logits = []
    for t in range(forced.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
        pos = pos[:, -1:] + 1
        mask4d = create_masks_for_generate(
            config=model.config, inputs_embeds=torch.empty(mask.shape[0], 1, 0, dtype=model.dtype, device=DEV),
            attention_mask=mask, cache=cache, position_ids=pos)
        out = forward(input_ids=forced[:, t:t + 1], attention_mask=mask4d, position_ids=pos, cache=cache,
                      use_cache=True)
        logits.append(out.logits[:, -1].float().clone())
    return torch.stack(logits, 1)


@pytest.mark.parametrize("backend", KERNELS)
def test_cuda_graphs_teacher_forced_match_uncompiled(backend, monkeypatch):
    """The decode step compiled with CUDA graphs (torch.compile mode="reduce-overhead", as generate() does for a
    static cache) is re-planned before every replay: 64 steps over a growing context match the uncompiled run."""
    _available(backend)
    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", backend)
    torch._dynamo.reset()
    model = _model("v3")
    model.set_attn_implementation("flashinfer_mla")
    plain = _teacher_forced_static(model, model)
    graphed = _teacher_forced_static(model, torch.compile(model.forward, mode="reduce-overhead"))
    err, top1 = _compare(graphed, plain)
    print(f"cuda graphs {backend}: teacher-forced logits rel err {err:.2e}, top-1 agreement {top1:.3f}")
    assert torch.isfinite(graphed).all()
    assert err < LOGIT_TOL and top1 >= TOP1_MIN
    del model
    torch.cuda.empty_cache()


def test_generate_static_cache_graphs_equal_compiled_without_graphs():
    """generate(cache_implementation="static") compiles the decode step itself; with CUDA graphs (replays) it
    produces exactly what the same compiled step produces without graphs (every step planned and launched)."""
    _available("fa3")
    from transformers import CompileConfig

    model = _model("v3")
    model.set_attn_implementation("flashinfer_mla")
    ids, mask, _ = _prompts()
    runs = {}
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        runs[mode] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                    cache_implementation="static", compile_config=CompileConfig(mode=mode),
                                    output_logits=True, return_dict_in_generate=True)
    err = rel(torch.stack(runs["reduce-overhead"].logits), torch.stack(runs["default"].logits))
    print(f"generate with CUDA graphs vs compiled without: logits rel err {err:.2e}")
    # No recompilation per step or per call: a further 24-step generate compiles no new graph.
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    again = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                           cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"))
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(again, runs["reduce-overhead"].sequences)
    assert torch.equal(runs["reduce-overhead"].sequences, runs["default"].sequences)
    assert err < 1e-3
    del model
    torch.cuda.empty_cache()
