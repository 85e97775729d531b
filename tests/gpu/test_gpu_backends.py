"""FlashInfer MLA kernels on a real GPU, against the reference backend and Transformers' eager (bf16).

Run with ``python -m pytest -q tests/gpu -s`` (``-s`` prints the error table). Without CUDA the same tests run on
the CPU stand-ins (``gpu_suite.py``: float32 models of the same structure, bounds at least float32's rounding),
except those marked `needs_cuda`: CUDA-graph capture, CUDA's sync debug mode.

The model-level bounds are not numbers tuned on one card: `yardstick(shape)` measures, in the same process and on
the same inputs, how far two correct bf16 implementations of the model land from eager (the reference backend, the
absorbed math in plain PyTorch; sdpa is measured beside it and must agree), and `Bounds` allows a fast path a
stated factor of that distance. The bounds are checked to be discriminating: the same comparison with a
deliberately wrong softmax scale or a plan that leaks the padding must fail them, and each control asserts that its
fault was injected where the decode path really runs (`test_bounds_catch_wrong_scale_and_mask`).

Where the decode path is observed or faulted: ``kernels.fa.build`` (every fa2/fa3 plan a step builds; the step's
plan calls it through ``plan.FAMILIES``, i.e. as a module attribute at call time), ``kernels.fa.run`` (every fa2/fa3
launch), ``plan.StepPlan.rows`` (the rows every builder reads), ``rows.Rows.from_mask`` (the one read of a step's
mask) and ``plan.StepPlan.load_graph_slots`` (the reload of the CUDA-graph slots before a replay).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import transformers
from gpu_suite import CUDA, DEV, DTYPE, RANK, ROPE, ROUNDING, needs_cuda, sized
from transformers import DynamicCache, StaticCache

import hf_flashinfer_mla
from hf_flashinfer_mla import capabilities
from hf_flashinfer_mla.kernels import Refused, fa, graphs
from hf_flashinfer_mla.plan import StepPlan, decode_latent
from hf_flashinfer_mla.rows import Rows

KERNELS = ["fa3", "fa2"]
KERNEL_TOL = 2e-2 if CUDA else ROUNDING  # bf16 operands: ~3e-3 observed for a correct kernel
# Inductor settings under which two compiles of one step run the same kernels: no choice made by timing them on the
# GPU (reduction block sizes, pointwise configs, matmul padding: the first two change the bf16 rounding), and no
# compiled artifact or timing result read from inductor's on-disk caches, which earlier compiles (other settings,
# other processes) wrote. `scripts/dev/probe_graph_modes.py` shows what differs without them.
NO_TIMED_CHOICES = {"deterministic": True, "test_configs.force_filter_reduction_configs": True,
                    "triton.autotune_pointwise": False, "shape_padding": False, "fx_graph_cache": False,
                    "autotune_local_cache": False}
# A correct fast path lands about as far from eager as the reference does (bf16 rounding in another order; with
# random weights many logits are near-tied, so top-1 flips are rounding too). It may be REL_FACTOR times as far, and
# disagree on TOP1_FACTOR times as many top-1 tokens (plus a count's noise, `Bounds.around`). A 10% wrong softmax
# scale lands 1.5-3x as far, a plan leaking the padding 2.4-4.7x (test_bounds_catch_wrong_scale_and_mask).
REL_FACTOR = 1.25
TOP1_FACTOR = 1.5
# sdpa, Transformers' own fused attention, against eager: the yardstick is sound only if the reference is not
# farther from eager than a few times sdpa's distance (a reference gone wrong would otherwise widen every bound).
SDPA_FACTOR = 2.0


def _available(backend):
    reason = capabilities.unavailable_reason(backend, DEV, DTYPE, RANK, ROPE, 16)
    if reason:
        pytest.skip(f"{backend}: {reason}")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@dataclasses.dataclass(frozen=True)
class Bounds:
    """How far from its oracle a correct bf16 run may land: `rel` (relative error of the logits, exclusive) and
    `top1` (least top-1 agreement), derived from a distance measured in the same run."""

    rel: float
    top1: float

    @classmethod
    def around(cls, yard_rel: float, yard_top1: float, positions: int) -> "Bounds":
        """`positions` logits rows were compared: the yardstick's top-1 flips are a count, and a small count is
        noisy (Poisson: two standard deviations, and two flips more). On the stand-ins `rel` is at least
        `gpu_suite.ROUNDING`."""
        flips = (1 - yard_top1) * positions
        allowed = TOP1_FACTOR * flips + 2 * flips**0.5 + 2
        return cls(max(REL_FACTOR * yard_rel, 0.0 if CUDA else ROUNDING), 1 - allowed / positions)

    def holds(self, err: float, top1: float) -> bool:
        return err < self.rel and top1 >= self.top1

    def widened(self, rel: float, disagreement: float) -> "Bounds":
        """These bounds plus another source of difference (the triangle inequality for `rel`, the union bound for
        top-1 disagreements)."""
        return Bounds(self.rel + rel, self.top1 - disagreement)

    def __str__(self):
        return f"rel < {self.rel:.2e}, top-1 >= {self.top1:.3f}"


def _decode(step, requested, *operands):
    """`plan.decode_latent` (one layer routed on the step `step` as the attention function routes it), and the
    route it took: the backend it landed on after any refusal."""
    before = set(step.routes)
    out = decode_latent(step, requested, *operands)
    added = [route for key, route in step.routes.items() if key not in before]
    assert len(added) == 1, "decode_latent routes each call once"
    return out, added[0]


# ---------------------------------------------------------------- kernel level
def _latent_case(b, h, s, left_pad, static_tail, seed=0, layer_layout=None, q_len=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    cap = s + static_tail
    if layer_layout is not None:  # MLALatentLayer: "latent" (its default on this GPU: split) or "packed"
        layer = hf_flashinfer_mla.MLALatentLayer(packed=True if layer_layout == "packed" else None)
        layer.update(torch.randn(b, 1, s, RANK, device=DEV, dtype=DTYPE, generator=g),
                     torch.randn(b, 1, s, ROPE, device=DEV, dtype=DTYPE, generator=g))
        assert layer.packed is (layer_layout == "packed")
        kv, kr = layer.keys, layer.values
    else:
        kv = torch.randn(b, 1, cap, RANK, device=DEV, dtype=DTYPE, generator=g)[:, :, :cap]
        kr = torch.randn(b, 1, cap, ROPE, device=DEV, dtype=DTYPE, generator=g)[:, :, :cap]
    mask = torch.ones(b, 1, q_len, kv.shape[2], dtype=torch.bool, device=DEV).tril(kv.shape[2] - q_len)
    for i, p in enumerate(left_pad):
        mask[i, ..., :p] = False
    if static_tail and layer_layout is None:
        mask[..., s:] = False  # the static cache's unfilled tail
        kv[:, :, s:] = 1e4  # garbage in the unfilled tail, which must be skipped
        kr[:, :, s:] = 1e4
    for i, p in enumerate(left_pad):
        kv[i, :, :p] = 1e4  # padding garbage that must be skipped
    q_lat = torch.randn(b, h, q_len, RANK, device=DEV, dtype=DTYPE, generator=g) * 0.05
    q_pe = torch.randn(b, h, q_len, ROPE, device=DEV, dtype=DTYPE, generator=g) * 0.05
    return q_lat, q_pe, kv, kr, mask


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("layout", ["dynamic", "static", "latent", "packed"])
def test_kernel_matches_reference(backend, heads, layout):
    _available(backend)
    q_lat, q_pe, kv, kr, mask = _latent_case(
        4, heads, 300, left_pad=[0, 17, 64, 299], static_tail=37 if layout == "static" else 0,
        layer_layout=layout if layout in ("latent", "packed") else None,
    )
    step = StepPlan(mask)
    scale = 192**-0.5
    ref = decode_latent(step, "reference", q_lat.double(), q_pe.double(), kv.double(), kr.double(), scale)
    out, route = _decode(step, backend, q_lat, q_pe, kv, kr, scale)
    err = rel(out, ref)
    print(f"kernel {backend} H={heads} {layout}: rel err {err:.2e}")
    assert route.backend == backend  # the kernel ran, not a fallback
    assert torch.isfinite(out).all()
    assert err < KERNEL_TOL


def _refusals(monkeypatch):
    """Record every plan FlashInfer declines (`kernels.Refused` from the fa2/fa3 builder; the step then tries the
    next backend of its chain: fa2, then the reference backend)."""
    refused = []
    real = fa.build

    def build(backend, step, layer, into=None, staged=None):
        try:
            return real(backend, step, layer, into=into, staged=staged)
        except Refused as exc:
            refused.append((backend, layer.heads, str(exc)))
            raise

    monkeypatch.setattr(fa, "build", build)
    return refused


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("heads", [16, 20, 24, 64, 128])
@pytest.mark.parametrize("q_len", [2, 3, 5, 8])
def test_multi_token_causal_kernel_matches_reference(backend, heads, q_len, monkeypatch):
    """2-8 query tokens per sequence (assisted decoding) on causal plans, over several cached lengths so that
    FlashInfer's causal tile bound refuses some steps at head counts not dividing its query tile (20, 24): the
    step's route (``StepPlan.route``, as the attention function resolves it) then falls to fa2 or the reference,
    and the result still matches the reference."""
    _available(backend)
    refused = _refusals(monkeypatch)
    scale, worst, fallbacks = 192**-0.5, 0.0, set()
    # Cached lengths (minus the left padding below) hitting and missing FlashInfer's 64-key tile boundaries: its
    # causal tile bound refuses 8-token steps at 20 heads when a row holds 2 mod 64 tokens, at 24 heads 3 mod 64.
    for s in (66, 67, 130, 200):
        q_lat, q_pe, kv, kr, mask = _latent_case(3, heads, s, left_pad=[0, 9, 40], static_tail=0,
                                                 layer_layout="latent", q_len=q_len, seed=s)
        step = StepPlan(mask)
        ref = decode_latent(step, "reference", q_lat.double(), q_pe.double(), kv.double(), kr.double(), scale)
        out, route = _decode(step, backend, q_lat, q_pe, kv, kr, scale)
        fallbacks.add(route.backend)
        assert torch.isfinite(out).all()
        worst = max(worst, rel(out, ref))
    print(f"causal {backend} H={heads} q={q_len}: rel err {worst:.2e}, backends {sorted(fallbacks)}, "
          f"refused {len(refused)}")
    assert worst < KERNEL_TOL
    tile_q = 128 if q_len * heads > 64 else 64
    if any(end % heads for end in range(tile_q, q_len * heads, tile_q)):
        assert refused, "this shape should have hit FlashInfer's causal tile bound at one of the lengths"
    else:
        assert not refused and fallbacks == {backend}


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
    cfg = getattr(transformers, cls)(**sized(vocab_size=4096, num_hidden_layers=2, kv_lora_rank=512,
                                           qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                           max_position_embeddings=8192, initializer_range=0.05, eos_token_id=None,
                                           pad_token_id=0, **kw))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=DTYPE).to(DEV).eval()


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
    """"dynamic": Transformers' own concatenating layers (a `DynamicCache` built without the config: one built from
    a flashinfer_mla model's config gets the package's latent layers, as "latent" does); "own": none, so the model's
    forward builds its cache (a loop of the user's own, classifier-free guidance's forward)."""
    if kind == "own":
        return None
    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=64 + 64 + 16)
    if kind == "latent":
        return hf_flashinfer_mla.MLALatentCache(config=model.config)
    return DynamicCache()


def _compare(ours, oracle):
    top1 = (ours.argmax(-1) == oracle.argmax(-1)).float().mean().item()
    return rel(ours, oracle), top1


@functools.cache
def _runs(shape):
    """The shape's model (left in flashinfer_mla) and its 64 teacher-forced steps under eager, sdpa and the reference
    backend, once per process."""
    model = _model(shape)
    eager = _teacher_forced(model, DynamicCache(config=model.config))
    model.set_attn_implementation("sdpa")
    sdpa = _teacher_forced(model, DynamicCache(config=model.config))
    model.set_attn_implementation("flashinfer_mla")
    reference = _teacher_forced(model, DynamicCache(config=model.config), mla_backend="reference")
    return model, eager, sdpa, reference


@functools.cache
def yardstick(shape="v3") -> Bounds:
    """The bounds for a fast path of `shape`'s attention, from the reference backend's distance to eager on 64
    teacher-forced steps of the same inputs, measured now on this card. sdpa's distance is measured beside it: a
    reference farther from eager than `SDPA_FACTOR` times sdpa's would widen every bound, and fails here instead."""
    _, eager, sdpa, reference = _runs(shape)
    ref_rel, ref_top1 = _compare(reference, eager)
    sdpa_rel, sdpa_top1 = _compare(sdpa, eager)
    bounds = Bounds.around(ref_rel, ref_top1, eager.shape[0] * eager.shape[1])
    print(f"yardstick {shape}: reference vs eager rel {ref_rel:.2e} top1 {ref_top1:.3f} | sdpa vs eager rel "
          f"{sdpa_rel:.2e} top1 {sdpa_top1:.3f} -> bounds {bounds}")
    assert ref_rel < max(SDPA_FACTOR * sdpa_rel, 0.0 if CUDA else ROUNDING), (
        "the reference backend is far from eager: the yardstick is unsound")
    return bounds


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request):
    model, eager, _, reference = _runs(request.param)
    yield request.param, model, eager, reference, yardstick(request.param)
    model.set_attn_implementation("flashinfer_mla")


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("cache_kind", ["dynamic", "static", "latent", "own"])
def test_teacher_forced_64_steps_match_eager_and_reference(shaped, backend, cache_kind):
    _available(backend)
    name, model, eager, reference, bounds = shaped
    ours = _teacher_forced(model, _cache(cache_kind, model), mla_backend=backend)
    err_e, top1_e = _compare(ours, eager)
    err_r, top1_r = _compare(ours, reference)
    ref_e, ref_top1 = _compare(reference, eager)
    print(f"{name} {backend} {cache_kind}: vs eager rel {err_e:.2e} top1 {top1_e:.3f} | vs reference rel "
          f"{err_r:.2e} top1 {top1_r:.3f} | reference vs eager rel {ref_e:.2e} top1 {ref_top1:.3f}")
    assert torch.isfinite(ours).all()
    assert bounds.holds(err_e, top1_e), f"vs eager: {bounds}"
    assert bounds.holds(err_r, top1_r), f"vs reference: {bounds}"


def test_bounds_catch_wrong_scale_and_mask(shaped, monkeypatch):
    """A kernel fed a 10% wrong scale, or a plan that leaks the left padding, must fail the bounds above. Each
    fault is injected where the decode path really runs (``kernels.fa.run`` launches every fa2/fa3 layer, with the
    layer spec whose scale the generated module is given; ``StepPlan.rows`` hands every builder the step's rows)
    and the control asserts it was reached: a control that stopped injecting (the decode path moved) fails
    instead of passing silently."""
    backend = "fa3" if capabilities.unavailable_reason("fa3", DEV, DTYPE, RANK, ROPE, 16) is None else "fa2"
    _available(backend)
    # FlashInfer's public wrapper takes the scale at plan time, not at the launch this control wraps.
    assert fa.uses_generated_module(), "the wrong-scale control needs FlashInfer's generated-module path"
    name, model, eager, _, bounds = shaped
    layers = model.config.num_hidden_layers
    launches, leaks = [], []
    real_run = fa.run

    def wrong_scale(meta, layer, *args, **kwargs):
        launches.append(layer.scale)
        return real_run(meta, dataclasses.replace(layer, scale=layer.scale * 1.1), *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(fa, "run", wrong_scale)
        wrong = _compare(_teacher_forced(model, DynamicCache(config=model.config), mla_backend=backend), eager)
    assert len(launches) == 64 * layers  # every decode layer of every step ran with the fault

    def leaky_rows(step):
        leaks.append(step)  # (kept alive: distinct plans have distinct ids)
        valid = step.mask[:, 0, -1, :]
        return Rows.from_mask(torch.ones_like(valid), step.q_len)  # padding included

    with monkeypatch.context() as m:
        m.setattr(StepPlan, "rows", leaky_rows)
        leaky = _compare(_teacher_forced(model, DynamicCache(config=model.config), mla_backend=backend), eager)
    assert len({id(step) for step in leaks}) == 64  # every step's plan leaked (its builder read these rows)
    print(f"{name} controls: wrong scale rel {wrong[0]:.2e} top1 {wrong[1]:.3f}; "
          f"leaky mask rel {leaky[0]:.2e} top1 {leaky[1]:.3f}; bounds {bounds}")
    for err, top1 in (wrong, leaky):
        assert not bounds.holds(err, top1)


@torch.no_grad()
def _decode_in_chunks(model, cache, q_len, steps=12, **kwargs):
    """Prefill the prompts, then feed the forced tokens `q_len` at a time (as assisted decoding verifies drafts)."""
    ids, mask, forced = _prompts()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    logits = []
    steps = min(steps, forced.shape[1] // q_len)  # as many whole chunks as the forced tokens hold
    for t in range(0, q_len * steps, q_len):
        mask = torch.cat([mask, torch.ones_like(mask[:, :q_len])], -1)
        pos = pos[:, -1:] + 1 + torch.arange(q_len, device=DEV)
        out = model(input_ids=forced[:, t : t + q_len], attention_mask=mask, position_ids=pos, cache=out.cache,
                    use_cache=True, **kwargs)
        logits.append(out.logits.float())
    return torch.cat(logits, 1)


def _small_v3(heads):
    """Two dense layers with DeepSeek's latent (512 + 64) and `heads` heads, hidden 2048."""
    cfg = transformers.DeepseekV3Config(**sized(
        vocab_size=4096, hidden_size=2048, intermediate_size=2048, num_hidden_layers=2, first_k_dense_replace=2,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=None, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=8192,
        initializer_range=0.05, eos_token_id=None, pad_token_id=0, n_group=1, topk_group=1))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=DTYPE).to(DEV).eval()


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("heads", [16, 20, 24])
@pytest.mark.parametrize("q_len", [2, 4, 8])
def test_multi_token_decode_matches_eager(backend, heads, q_len, monkeypatch):
    """Whole model, 2-8 query tokens per step on causal plans, against eager fed the same chunks. At 20 and 24
    heads FlashInfer may refuse some of these plans (causal tile bound, see the kernel-level test above, which
    hits it on purpose): such steps fall back, nothing raises."""
    _available(backend)
    refused = _refusals(monkeypatch)
    model = _small_v3(heads)
    eager = _decode_in_chunks(model, DynamicCache(config=model.config), q_len)
    model.set_attn_implementation("flashinfer_mla")
    reference = _decode_in_chunks(model, hf_flashinfer_mla.MLALatentCache(config=model.config), q_len,
                                  mla_backend="reference")
    ours = _decode_in_chunks(model, hf_flashinfer_mla.MLALatentCache(config=model.config), q_len,
                             mla_backend=backend)
    err, top1 = _compare(ours, eager)
    bounds = Bounds.around(*_compare(reference, eager), positions=eager.shape[0] * eager.shape[1])
    print(f"multi-token {backend} H={heads} q={q_len}: vs eager rel {err:.2e} top1 {top1:.3f} ({bounds}), "
          f"{len(refused)} plan(s) refused")
    assert torch.isfinite(ours).all()
    assert bounds.holds(err, top1)
    del model
    torch.cuda.empty_cache()


def test_prefill_chunks_inside_left_padding_match_eager(monkeypatch):
    """``generate(prefill_chunk_size=8)`` on a left-padded batch (prompts of 70, 3 and 37 tokens): the chunks that
    lie inside a row's padding, or end in it, show that row fewer positions than they have query tokens, which the
    kernels refuse (here every chunk: those steps run on the reference); the decode steps run on fa3. The prefill's
    logits are eager's, which runs the same chunks. (Only the prefill's: greedy bf16 generations part after a
    near-tie, eager's own chunked and unchunked runs among them.)"""
    _available("fa3")
    refused = _refusals(monkeypatch)
    runs = []
    real_run = fa.run
    monkeypatch.setattr(fa, "run", lambda *a, **k: runs.append(1) or real_run(*a, **k))
    model = _model("v3")
    ids, mask, _ = _prompts(lengths=(70, 3, 37))

    def generate():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                 prefill_chunk_size=8, output_logits=True, return_dict_in_generate=True)
        return out.logits[0].float()

    eager = generate()
    model.set_attn_implementation("flashinfer_mla")
    ours = generate()
    err, top1 = _compare(ours, eager)
    shorter = [r for r in refused if "fewer cached positions" in r[2]]
    print(f"prefill chunks in left padding: prefill's logits vs eager rel {err:.2e} top1 {top1:.3f}; "
          f"{len(shorter)} refusal(s) of a row shorter than its step, {len(runs)} fa3 launch(es)")
    del model
    torch.cuda.empty_cache()
    assert shorter and runs and torch.isfinite(ours).all()
    assert err < yardstick("v3").rel


def test_generate_plans_on_the_host_and_matches_the_mask_planned_path(monkeypatch):
    """generate() plans its decode steps from host-known rows (one read of the padding per call); a loop of the
    user's own feeding the same tokens plans from the mask. Same rows, same kernel: the same logits."""
    _available("fa3")
    model = _model("v3")
    model.set_attn_implementation("flashinfer_mla")
    from_mask = []
    real_from_mask = Rows.from_mask.__func__
    monkeypatch.setattr(Rows, "from_mask", classmethod(lambda cls, *a: from_mask.append(1) or real_from_mask(cls, *a)))
    ids, mask, _ = _prompts()
    new = 24
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    assert from_mask == []  # generate() never read a step's mask
    host_planned = torch.stack(gen.logits, 1).float()[:, 1:]  # the decode steps (the first logits are prefill's)
    tokens = gen.sequences[:, ids.shape[1]:]
    with torch.no_grad():
        cache = hf_flashinfer_mla.MLALatentCache(config=model.config)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
        loop = []
        for t in range(new - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=tokens[:, t : t + 1], attention_mask=mask, position_ids=pos, cache=out.cache,
                        use_cache=True)
            loop.append(out.logits[:, -1].float())
    assert len(from_mask) == new - 1
    err = rel(host_planned, torch.stack(loop, 1))
    print(f"host-planned (generate) vs mask-planned: logits rel err {err:.2e}")
    assert err < 1e-3
    assert torch.equal(host_planned.argmax(-1), torch.stack(loop, 1).argmax(-1))


@needs_cuda("Transformers' offloaded cache prefetches each layer on a CUDA stream")
def test_offloaded_cache_generate_matches_the_resident_cache(monkeypatch):
    """``generate(cache_implementation="offloaded")``: Transformers moves each layer's cache to the CPU after its
    update and prefetches the next layer's back on a side stream; the latent layers (``MLALatentLayer``) move their
    buffers. Same rows, same kernel as the resident cache: the same logits, every decode layer on fa3, and the
    layers really went to the CPU and back."""
    _available("fa3")
    model = _model("v3")
    model.set_attn_implementation("flashinfer_mla")
    launches, moves = [], []
    real_run = fa.run
    real_offload, real_prefetch = hf_flashinfer_mla.MLALatentLayer.offload, hf_flashinfer_mla.MLALatentLayer.prefetch
    monkeypatch.setattr(fa, "run", lambda *a, **k: launches.append(1) or real_run(*a, **k))
    monkeypatch.setattr(hf_flashinfer_mla.MLALatentLayer, "offload",
                        lambda self: moves.append("offload") or real_offload(self))
    monkeypatch.setattr(hf_flashinfer_mla.MLALatentLayer, "prefetch",
                        lambda self: moves.append("prefetch") or real_prefetch(self))
    ids, mask, _ = _prompts()
    new, layers = 16, model.config.num_hidden_layers
    runs = {}
    for kind in (None, "offloaded"):
        launches.clear()
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                 cache_implementation=kind, output_logits=True, return_dict_in_generate=True)
        assert len(launches) == layers * (new - 1)  # every decode layer on fa3, offloaded or not
        runs[kind] = (torch.stack(gen.logits, 1).float(), gen.sequences)
    assert moves.count("offload") >= layers * new and moves.count("prefetch") >= layers * new
    err = rel(runs["offloaded"][0], runs[None][0])
    print(f"offloaded vs resident cache: logits rel err {err:.2e}, {moves.count('offload')} offloads")
    assert err < 1e-3
    assert torch.equal(runs["offloaded"][1], runs[None][1])


@needs_cuda("torch's CUDA sync debug mode")
def test_generate_decode_steps_do_not_sync(monkeypatch):
    """No device-to-host synchronisation in a generate() decode step after the first (which reads the left
    padding once): torch's sync debug mode raises on any sync inside the model's forward."""
    _available("fa3")
    model = _model("v3")  # two dense layers: nothing in Transformers' own decode step syncs
    model.set_attn_implementation("flashinfer_mla")
    forwards = []

    def strict(module, args, kwargs):
        forwards.append(1)
        if len(forwards) > 2:  # prefill, first decode step (reads the padding), then every step must be sync-free
            torch.cuda.set_sync_debug_mode("error")

    def relax(module, args, kwargs, output):
        torch.cuda.set_sync_debug_mode("default")

    hooks = [model.register_forward_pre_hook(strict, with_kwargs=True),
             model.register_forward_hook(relax, with_kwargs=True)]
    ids, mask, _ = _prompts()
    try:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        for h in hooks:
            h.remove()
    assert len(forwards) == 12  # 10 decode steps ran in error mode
    # The control: the same mode does catch a sync in a forward (reading the step's mask, as a user loop plans).
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            Rows.from_mask(torch.ones(2, 8, dtype=torch.bool, device=DEV), 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_planners_agree_with_the_reference(monkeypatch):
    """FlashInfer's generated module called directly and its public wrapper (``HF_FLASHINFER_MLA_FA_PLANNER=wrapper``)
    give the reference backend's logits, and each run used the planner it was told to (the wrapper's plan is spied
    on: never called by the direct planner, once per step by the wrapper)."""
    _available("fa3")
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    model = _model("v2-lite")
    model.set_attn_implementation("flashinfer_mla")
    wrapper_plans = []
    real_plan = BatchMLAPagedAttentionWrapper.plan
    monkeypatch.setattr(BatchMLAPagedAttentionWrapper, "plan",
                        lambda self, *a, **k: wrapper_plans.append(1) or real_plan(self, *a, **k))
    reference = _teacher_forced(model, DynamicCache(config=model.config), mla_backend="reference")
    logits, plans = {}, {}
    for planner in ("direct", "wrapper"):
        monkeypatch.setenv(fa.PLANNER_ENV, planner)
        assert fa.uses_generated_module() is (planner == "direct")
        before = len(wrapper_plans)
        logits[planner] = _teacher_forced(model, DynamicCache(config=model.config), mla_backend="fa3")
        plans[planner] = len(wrapper_plans) - before
    for planner, out in logits.items():
        err, top1 = _compare(out, reference)
        print(f"planner {planner} vs reference: logits rel err {err:.2e}, top-1 {top1:.3f}")
        assert yardstick("v2-lite").holds(err, top1)
    print(f"direct vs wrapper: logits rel err {rel(logits['wrapper'], logits['direct']):.2e}; wrapper plans {plans}")
    assert plans["direct"] == 0 and plans["wrapper"] == 64  # one plan per teacher-forced step
    assert rel(logits["wrapper"], logits["direct"]) < 1e-3


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


@needs_cuda("CUDA-graph capture and replay (torch.compile's reduce-overhead)")
@pytest.mark.parametrize("backend", KERNELS)
def test_cuda_graphs_teacher_forced_match_uncompiled(backend, monkeypatch):
    """The decode step compiled with CUDA graphs (torch.compile mode="reduce-overhead", as generate() does for a
    static cache) is re-planned before every replay: 64 steps over a growing context match the uncompiled run."""
    _available(backend)
    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", backend)
    hf_flashinfer_mla.reset()
    model = _model("v3")
    model.set_attn_implementation("flashinfer_mla")
    plain = _teacher_forced_static(model, model)
    graphed = _teacher_forced_static(model, torch.compile(model.forward, mode="reduce-overhead"))
    err, top1 = _compare(graphed, plain)
    print(f"cuda graphs {backend}: teacher-forced logits rel err {err:.2e}, top-1 agreement {top1:.3f}")
    # The compiled step ran the graph op on a CUDA-graph slot of the forced backend, not on the reference.
    assert any(shape.runs == backend and shape.batch == 4 for shape in hf_flashinfer_mla.captured_shapes())
    assert torch.isfinite(graphed).all()
    assert yardstick("v3").holds(err, top1)
    del model
    torch.cuda.empty_cache()


def _teacher_forced_own_masks(model, forward):
    """`_teacher_forced_static`'s steps, each handed a 4D boolean mask of the caller's own (built by hand, a new
    tensor per step): the mask function never sees it."""
    ids, mask, forced = _prompts()
    max_len = 64 + 64 + 16
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    logits = []
    for t in range(forced.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
        pos = pos[:, -1:] + 1
        mask4d = torch.zeros(mask.shape[0], 1, 1, max_len, dtype=torch.bool, device=DEV)
        mask4d[:, 0, 0, : mask.shape[1]] = mask.bool()
        out = forward(input_ids=forced[:, t:t + 1], attention_mask=mask4d, position_ids=pos, cache=cache,
                      use_cache=True)
        logits.append(out.logits[:, -1].float().clone())
    return torch.stack(logits, 1)


@needs_cuda("replays of a captured CUDA graph (the control's stale slots; uncaptured, every call reloads them)")
@torch.no_grad()
def test_cuda_graphs_handed_the_callers_own_4d_masks_match_uncompiled(monkeypatch):
    """A forward compiled with CUDA graphs by the caller and handed 4D masks of the caller's own: nothing reloads a
    kernel's slot before a replay, so the graphs run the reference backend and 64 steps match the uncompiled run.
    Control: with a rule under which every graph handed a mask takes the slots, the replays run on the captured
    step's schedule and the logits part from the uncompiled run's."""
    _available("fa3")
    model = _model("v3")
    model.set_attn_implementation("flashinfer_mla")
    plain = _teacher_forced_own_masks(model, model)
    results = {}
    for rule in ("mask function", "any mask"):
        torch._dynamo.reset()
        if rule == "any mask":
            monkeypatch.setattr(graphs, "mask_planned_outside_graph", lambda: True)
        graphed = _teacher_forced_own_masks(model, torch.compile(model.forward, mode="reduce-overhead"))
        results[rule] = _compare(graphed, plain)
        print(f"cuda graphs, the caller's 4D masks, {rule}: rel err {results[rule][0]:.2e}, top-1 "
              f"{results[rule][1]:.3f}")
    bounds = yardstick("v3")
    assert bounds.holds(*results["mask function"])
    assert not bounds.holds(*results["any mask"])  # the control: stale slots are detected by these bounds
    del model
    torch.cuda.empty_cache()


@needs_cuda("CUDA-graph capture and replay against inductor's compiled step without graphs")
def test_generate_static_cache_graphs_equal_compiled_without_graphs(monkeypatch):
    """generate(cache_implementation="static") compiles the decode step itself; with CUDA graphs (replays) it
    produces exactly what the same compiled step produces without graphs (every step planned and launched). The
    graphs' slots are reloaded before every replay without a device sync (sync debug mode "error" around
    ``StepPlan.load_graph_slots``, which the mask function calls outside the compiled region).

    Both runs compile with `NO_TIMED_CHOICES`. Otherwise the two compiles may run one RMSNorm reduction with other
    block sizes (R0_BLOCK 2048 in one, 8192 in the other: timed on a loaded GPU, or read from inductor's caches),
    whose bf16 rounding differs now and then in one row, and a near tie later flips a greedy token: twice in
    fourteen runs of this test on an H200 (``scripts/dev/probe_graph_modes.py`` finds the kernels). With them
    both compiles run the same kernels, so any difference left is the package's."""
    _available("fa3")
    from transformers import CompileConfig

    model = _model("v3")
    model.set_attn_implementation("flashinfer_mla")
    ids, mask, _ = _prompts()
    planned = []
    real_load = StepPlan.load_graph_slots

    def strict_load(step, replaying=False):
        planned.append(len(graphs.slots_for(step.batch_size, step.q_len, step.kv_len)))
        torch.cuda.set_sync_debug_mode("error")
        try:
            real_load(step, replaying)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(StepPlan, "load_graph_slots", strict_load)
    runs = {}
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    with torch._inductor.config.patch(NO_TIMED_CHOICES):
        for mode in ("default", "reduce-overhead"):
            torch._dynamo.reset()
            runs[mode] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                        cache_implementation="static", compile_config=CompileConfig(mode=mode),
                                        output_logits=True, return_dict_in_generate=True)
        # Slots of the step's shape existed and were reloaded, sync-free.
        assert hf_flashinfer_mla.captured_shapes() and max(planned) > 0
        graphed, plain = torch.stack(runs["reduce-overhead"].logits), torch.stack(runs["default"].logits)  # [T, B, V]
        err = rel(graphed, plain)
        print(f"generate with CUDA graphs vs compiled without: logits rel err {err:.2e}")
        # No recompilation per step or per call: a further 24-step generate compiles no new graph.
        from torch._dynamo.utils import counters

        compiled = counters["stats"]["unique_graphs"]
        again = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                               cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"))
    assert counters["stats"]["unique_graphs"] == compiled
    assert torch.equal(again, runs["reduce-overhead"].sequences)
    # Where the runs part, the first step whose logits differ at all, and by how much (a near tie that flipped, or
    # a wrong step).
    differs = [t for t in range(graphed.shape[0]) if not torch.equal(graphed[t], plain[t])]
    where = "none" if not differs else (
        f"step {differs[0]} of {graphed.shape[0]}, rel err {rel(graphed[differs[0]], plain[differs[0]]):.2e}, rows "
        f"{[b for b in range(graphed.shape[1]) if not torch.equal(graphed[differs[0], b], plain[differs[0], b])]}")
    assert torch.equal(runs["reduce-overhead"].sequences, runs["default"].sequences), f"first differing logits: {where}"
    assert err < 1e-3, f"first differing logits: {where}"
    del model
    torch.cuda.empty_cache()
