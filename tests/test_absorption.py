"""Absorbed weights: never stale, never detached from autograd, never pinned to an old device, and derived for every
kv_b_proj Transformers can load: FP8 (block and per-tensor), custom linears, bitsandbytes.

Oracle: the same model (same quantized weights) run with Transformers' ``eager``; CPU, float64/float32.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import logging

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune
from helpers import (BNB_RANK, assert_batch_matches_eager_alone, count_calls, decode_logits, kv_b_proj_to_4bit,
                     left_padded_batch, make_model, rel_err)
from torch import nn
from transformers import DynamicCache
from transformers.integrations import finegrained_fp8

from hf_flashinfer_mla import absorption
from hf_flashinfer_mla.kernels import reference

NEW_TOKENS = 6


def _attention_modules(model):
    return [m for m in model.modules() if hasattr(m, "kv_b_proj")]


def _count_reference_calls(monkeypatch):
    """Count absorbed decode calls (on the CPU every absorbed decode runs the reference backend)."""
    return count_calls(monkeypatch, reference, "mla_attention_reference")


# ------------------------------------------------------------------- weights that follow training, copies and moves
def _train_steps(model, ids, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    grads = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads.append([m.kv_b_proj.weight.grad.clone() for m in _attention_modules(model)])
        opt.step()
    return grads


def test_training_after_no_grad_forward_matches_eager(monkeypatch):
    """A validation pass or generate() first, then training on a short batch (<= 8 tokens: the absorbed path):
    kv_b_proj gets the same gradients as with eager, and three SGD steps later the models agree."""
    ids = torch.randint(1, 90, (2, 6), generator=torch.Generator().manual_seed(3))
    models = {attn: make_model("deepseek_v3", attn=attn) for attn in ("flashinfer_mla", "eager")}
    for model in models.values():
        model.generate(input_ids=ids[:, :4], max_new_tokens=3, do_sample=False)  # under no_grad
        model.train()
    calls = _count_reference_calls(monkeypatch)
    ours, theirs = (_train_steps(models[a], ids) for a in ("flashinfer_mla", "eager"))
    assert calls, "the training forward did not take the absorbed path"
    for g_ours, g_eager in zip(ours, theirs):
        for a, b in zip(g_ours, g_eager):
            assert rel_err(a, b) < 1e-6  # float64 model, float32 RMSNorm inside
    for (name, p), q in zip(models["flashinfer_mla"].named_parameters(), models["eager"].parameters()):
        assert rel_err(p, q) < 1e-6 or (q.norm() == 0 and p.norm() == 0), name


def test_deepcopy_and_torch_save_after_training_and_generate():
    model = make_model("deepseek_v2")
    ids, mask, _ = left_padded_batch(lengths=(4, 6))
    model.train()
    model(input_ids=ids[:, -5:], labels=ids[:, -5:], use_cache=False).loss.backward()
    copy.deepcopy(model)
    torch.save(model, io.BytesIO())
    model.eval()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    twin = copy.deepcopy(model)
    torch.save(model, io.BytesIO())
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(twin.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False), out)


def _extra_tensors(model):
    """Tensors a module holds outside its parameters and buffers (what `.to()` would not move)."""
    found = []
    for name, m in model.named_modules():
        for attr, value in vars(m).items():
            values = value.values() if isinstance(value, dict) else [value]
            if dataclasses.is_dataclass(value):
                values = [getattr(value, f.name) for f in dataclasses.fields(value)]
            if attr in ("_parameters", "_buffers"):
                continue
            found += [f"{name}.{attr}" for v in values if isinstance(v, torch.Tensor)]
    return found


def test_nothing_outlives_to_and_weights_never_go_stale():
    model = make_model("deepseek_v3")
    ids, mask, prompts = left_padded_batch(lengths=(5, 3))
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert _extra_tensors(model) == []
    # An in-place edit and a load_state_dict are seen by the very next decode step.
    with torch.no_grad():
        for m in _attention_modules(model):
            m.kv_b_proj.weight.mul_(1.5)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert_batch_matches_eager_alone(model, out, prompts, NEW_TOKENS, tol=1e-6)
    state = {k: v * 0.5 if "kv_b_proj" in k else v for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert_batch_matches_eager_alone(model, out, prompts, NEW_TOKENS, tol=1e-6)
    # A new weight object, then a dtype change (new storage): the views kept for inference are of the live weight.
    for m in _attention_modules(model):
        m.kv_b_proj.weight = nn.Parameter(m.kv_b_proj.weight.detach().flip(0).clone())
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert_batch_matches_eager_alone(model, out, prompts, NEW_TOKENS, tol=1e-6)
    model.to(torch.float32)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert_batch_matches_eager_alone(model, out, prompts, NEW_TOKENS, tol=1e-5)
    model.to("meta")
    assert all(t.device.type == "meta" for t in model.state_dict().values())
    assert _extra_tensors(model) == []


@torch.no_grad()
@pytest.mark.parametrize("move", ["float64", "half", "meta"])
def test_to_lets_the_old_weights_go_at_once(move):
    """After a decode, ``.to()`` (another dtype, another device) frees each kv_b_proj weight's old memory at once,
    as with sdpa: the absorbed views kept for the next decode are dropped before the move (they held the old storage
    until the layer's next decode, which a model moved off its GPU never has). The moved model still decodes."""
    from torch.multiprocessing.reductions import StorageWeakRef

    model = make_model("deepseek_v3", dtype=torch.float32)
    ids, mask, prompts = left_padded_batch(lengths=(5, 3))
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    old = [StorageWeakRef(m.kv_b_proj.weight.untyped_storage()) for m in _attention_modules(model)]
    assert len(old) == 2 and not any(ref.expired() for ref in old)
    {"float64": lambda: model.to(torch.float64), "half": model.half, "meta": lambda: model.to("meta")}[move]()
    assert all(ref.expired() for ref in old)
    if move == "float64":
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        assert_batch_matches_eager_alone(model, out, prompts, NEW_TOKENS, tol=1e-6)


# ------------------------------------------------------------------------------- quantized and custom kv_b_proj
def _fake_fp8_linear(input, weight, weight_scale_inv, block_size=None, bias=None, activation_scale=None,
                     allow_deepgemm=True):
    # What Transformers' FP8 kernel (a Hub kernel, absent offline) computes, up to its activation rounding.
    w = finegrained_fp8._dequantize_fp8_weight(weight, weight_scale_inv, block_size, input.dtype)
    return F.linear(input, w, None if bias is None else bias.to(input.dtype))


def to_fp8_linear(linear: nn.Linear, block_size) -> nn.Module:
    """An `FP8Linear` holding `linear`'s weight quantized to float8_e4m3fn, per [block] or per tensor."""
    w = linear.weight.detach().float()
    out_f, in_f = w.shape
    q = finegrained_fp8.FP8Linear(in_f, out_f, block_size=block_size, has_bias=linear.bias is not None)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    if block_size is None:
        scale = w.abs().max() / fmax
        q.weight.data = (w / scale).to(torch.float8_e4m3fn)
        q.weight_scale_inv.data = scale.reshape(())
    else:
        bo, bi = block_size
        blocks = w.reshape(out_f // bo, bo, in_f // bi, bi)
        scale = blocks.abs().amax(dim=(1, 3)) / fmax
        q.weight.data = (blocks / scale[:, None, :, None]).reshape(out_f, in_f).to(torch.float8_e4m3fn)
        q.weight_scale_inv.data = scale
    if linear.bias is not None:
        q.bias.data = linear.bias.detach().clone()
    return q.requires_grad_(False)


class GainLinear(nn.Linear):
    """A custom linear subclass (weight-norm-like gain), derived through the identity basis."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         dtype=linear.weight.dtype)
        self.load_state_dict(linear.state_dict())
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, linear.out_features, dtype=linear.weight.dtype))

    def forward(self, x):
        return F.linear(x, self.weight * self.gain[:, None], self.bias)


class CurvedLinear(nn.Linear):
    """Not linear in its input: must be detected and expanded through the module, never absorbed."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + 0.05 * (x[..., :1] ** 2)


@pytest.fixture
def known_test_linears(monkeypatch):
    """The test's own linear classes declared as depending on their tensors alone, as a user declares theirs."""
    monkeypatch.setattr(absorption, "KNOWN_LINEARS", absorption.KNOWN_LINEARS | {"GainLinear", "CurvedLinear"})


QUANTIZED = {
    "fp8-block": lambda lin: to_fp8_linear(lin, [16, 16]),
    "fp8-tensor": lambda lin: to_fp8_linear(lin, None),
    "custom-linear": lambda lin: GainLinear(lin).requires_grad_(False),
}


def _quantized_model(kind, model_type="deepseek_v3", **overrides):
    model = make_model(model_type, dtype=torch.float32, **overrides)
    for m in _attention_modules(model):
        m.kv_b_proj = QUANTIZED[kind](m.kv_b_proj)
    return model


@pytest.fixture
def fp8_kernel(monkeypatch):
    monkeypatch.setattr(finegrained_fp8, "fp8_linear", _fake_fp8_linear)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", list(QUANTIZED))
def test_quantized_kv_b_proj_matches_eager(kind, cache, fp8_kernel, known_test_linears, monkeypatch):
    model = _quantized_model(kind, attention_bias=kind == "custom-linear")
    ids, mask, prompts = left_padded_batch(lengths=(7, 4, 9))
    calls = _count_reference_calls(monkeypatch)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True,
                         **({"cache_implementation": "static"} if cache == "static" else {}))
    assert calls, "decode did not take the absorbed path"
    assert_batch_matches_eager_alone(model, out, prompts, NEW_TOKENS, tol=1e-4)


def test_dense_copy_lifecycle(fp8_kernel, caplog):
    """Derived only for layers that decode, logged once at INFO, moved by .to(), never saved, re-derived on change."""
    model = _quantized_model("fp8-block")
    ids, mask, prompts = left_padded_batch(lengths=(12, 9))
    model(input_ids=ids, attention_mask=mask)  # a prefill (> 8 tokens) only: nothing derived
    assert not any(n.endswith(absorption._DENSE) for n, _ in model.named_buffers())
    logging.Logger.info_once.cache_clear()  # Transformers' once-only logging: forget earlier tests' lines
    with caplog.at_level(logging.INFO, logger="hf_flashinfer_mla"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert sum("dense" in r.message for r in caplog.records) == 1
    dense = [n for n, _ in model.named_buffers() if n.endswith(absorption._DENSE)]
    assert len(dense) == len(_attention_modules(model))
    assert not any(absorption._DENSE in k for k in model.state_dict())
    # A changed scale is seen by the next decode step.
    with torch.no_grad():  # (an edit through `.data` bypasses the version counter, and with it this check)
        for m in _attention_modules(model):
            m.kv_b_proj.weight_scale_inv.mul_(1.25)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert_batch_matches_eager_alone(model, out, prompts, NEW_TOKENS, tol=1e-4)
    copy.deepcopy(model)
    model.to("meta")
    assert all(b.device.type == "meta" for _, b in model.named_buffers())
    assert _extra_tensors(model) == []


def test_non_linear_kv_b_proj_is_expanded_with_one_warning(known_test_linears, monkeypatch, caplog):
    model = make_model("deepseek_v2", dtype=torch.float64)
    for m in _attention_modules(model):
        curved = CurvedLinear(m.kv_b_proj.in_features, m.kv_b_proj.out_features, bias=False, dtype=torch.float64)
        curved.load_state_dict(m.kv_b_proj.state_dict())
        m.kv_b_proj = curved.requires_grad_(False)
    ids, mask, prompts = left_padded_batch(lengths=(7, 4, 9))
    calls = _count_reference_calls(monkeypatch)
    probes = []  # the identity-basis probe: a forward over rank + 3 rows
    real_forward = CurvedLinear.forward
    monkeypatch.setattr(CurvedLinear, "forward", lambda self, x: (
        probes.append(id(self)) if x.shape[0] == self.in_features + 3 else None, real_forward(self, x))[1])
    with caplog.at_level(logging.WARNING, logger="hf_flashinfer_mla"):
        for _ in range(2):  # a second call: nothing is probed or warned again while the modules stay as they are
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
    assert not calls
    assert sum("not a linear function" in r.message for r in caplog.records) == 1
    # one probe per module (it runs the module twice, to see that it is deterministic)
    assert sorted(probes) == sorted(2 * [id(m.kv_b_proj) for m in _attention_modules(model)])
    assert_batch_matches_eager_alone(model, out, prompts, NEW_TOKENS, tol=1e-6)
    for m in _attention_modules(model):  # a changed weight is a new state: probed again
        with torch.no_grad():
            m.kv_b_proj.weight.mul_(1.5)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert len(probes) == 4 * len(_attention_modules(model))  # (each probe runs the module twice)
    assert_batch_matches_eager_alone(model, out, prompts, NEW_TOKENS, tol=1e-6)


def test_dropout_in_train_mode_is_detected():
    """A PEFT-style adapter with dropout, in train mode, under no_grad: non-deterministic, so never absorbed."""
    model = make_model("deepseek_v2")
    attn = _attention_modules(model)[0]
    attn.kv_b_proj = nn.Sequential(attn.kv_b_proj, nn.Dropout(0.1)).requires_grad_(False)
    attn.kv_b_proj.train()
    with torch.no_grad():
        assert absorption.absorbed_weights(attn, torch.float64) is None
        attn.kv_b_proj.eval()
        assert absorption.absorbed_weights(attn, torch.float64) is not None


def test_trainable_custom_linear_keeps_its_gradient():
    """A custom linear whose parameters train must not be absorbed through a detached copy."""
    model = make_model("deepseek_v2")
    for m in _attention_modules(model):
        m.kv_b_proj = GainLinear(m.kv_b_proj)
    ids = torch.randint(1, 90, (2, 6), generator=torch.Generator().manual_seed(3))
    model.train()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for m in _attention_modules(model):
        assert m.kv_b_proj.gain.grad is not None and m.kv_b_proj.gain.grad.abs().sum() > 0


def test_bitsandbytes_4bit_matches_eager():
    model = make_model("deepseek_v3", dtype=torch.float32, kv_lora_rank=BNB_RANK)
    kv_b_proj_to_4bit(model)
    ids, mask, prompts = left_padded_batch(lengths=(7, 4, 9))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert_batch_matches_eager_alone(model, out, prompts, NEW_TOKENS, tol=1e-4)


def test_a_bitsandbytes_weight_repacked_for_its_cpu_kernel_is_absorbed_as_it_computes():
    """On CPUs with AVX512-BF16, bitsandbytes repacks a 4-bit weight at the first forward for its CPU kernel (bf16
    block scales, another layout). The derived matrix is then the repacked weight's, read through bitsandbytes' own
    inverse. Control: its dequantization handed the repacked weight as it is returns other values."""
    bnbf = pytest.importorskip("bitsandbytes.functional")
    if not hasattr(bnbf, "_convert_weight_packed_for_cpu"):
        pytest.skip("this bitsandbytes has no CPU repacking")
    model = make_model("deepseek_v3", dtype=torch.float32, kv_lora_rank=BNB_RANK)
    kv_b_proj_to_4bit(model)
    proj = model.model.layers[0].self_attn.kv_b_proj
    before = absorption._derive(proj, BNB_RANK, torch.float32)[0].clone()
    proj.weight.data, proj.weight.quant_state = bnbf._convert_weight_packed_for_cpu(proj.weight.data,
                                                                                  proj.weight.quant_state)
    assert proj.weight.quant_state.packing_format_for_cpu
    after = absorption._derive(proj, BNB_RANK, torch.float32)[0]
    assert proj.weight.quant_state.packing_format_for_cpu  # (the module keeps its repacked weight)
    assert rel_err(after, before) < 1e-2  # the same matrix, at the repacking's bf16 block scales
    as_is = bnbf.dequantize_4bit(proj.weight.data, proj.weight.quant_state).float()
    assert as_is.shape != before.shape or rel_err(as_is, before) > 0.1


def test_fp8_teacher_forced_matches_eager(fp8_kernel):
    model = _quantized_model("fp8-block", model_type="deepseek_v2")
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 9))
    forced = torch.randint(1, 90, (3, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = decode_logits(model, ids, mask, cache=DynamicCache(config=model.config), forced=forced)
        model.set_attn_implementation("eager")
        theirs = decode_logits(model, ids, mask, cache=DynamicCache(config=model.config), forced=forced)
    assert rel_err(ours, theirs) < 1e-4


def test_output_attentions_warns_in_its_own_name(caplog):
    model = make_model("deepseek_v2")
    ids, mask, _ = left_padded_batch(lengths=(12, 9))
    with caplog.at_level(logging.WARNING):
        model(input_ids=ids, attention_mask=mask, output_attentions=True)
    messages = [r.getMessage() for r in caplog.records]
    assert any("`flashinfer_mla` attention does not return attention weights" in m for m in messages)
    assert not any("`sdpa`" in m for m in messages)


class ScaledLinear(nn.Linear):
    """A user's linear whose output depends on a plain attribute, which no key over its tensors can see."""

    scale = 1.0

    def forward(self, x):
        return super().forward(x) * self.scale


def _hooked_output(proj):
    proj.register_forward_hook(lambda mod, args, out: out * 1.5)


def _hooked_input(proj):
    proj.register_forward_pre_hook(lambda mod, args: (args[0] * 2.0,))


def _pruned(proj):
    torch.nn.utils.prune.l1_unstructured(proj, "weight", amount=0.3)


def _weight_normed(proj):
    torch.nn.utils.parametrizations.weight_norm(proj)
    with torch.no_grad():
        proj.parametrizations.weight.original0.mul_(1.5)


def _own_state(proj):
    proj.__class__ = ScaledLinear  # (the same tensors; an attribute decides the output from here on)
    proj.scale = 2.0


def _accelerate_hook(proj):
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Scaled(ModelHook):
        def post_forward(self, module, output):
            return output * 1.5

    add_hook_to_module(proj, Scaled())  # (accelerate replaces the instance's forward)


def _accelerate_alignment(proj):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    add_hook_to_module(proj, AlignDevicesHook(execution_device="cpu", io_same_device=True))  # device_map's own


# What is done to each kv_b_proj after a first, absorbed generate(), and the warning it brings (None: none, the
# decode stays absorbed).
AFTER_ABSORBING = {
    "forward-hook": (_hooked_output, "it has forward hooks"),
    "forward-pre-hook": (_hooked_input, "it has forward hooks"),
    "pruned": (_pruned, "torch.nn.utils.prune.L1Unstructured"),
    "weight-norm": (_weight_normed, None),
    "accelerate-hook": (_accelerate_hook, "is replaced on the instance"),
    "accelerate-alignment": (_accelerate_alignment, None),
    "own-state": (_own_state, f"add \"{__name__}.ScaledLinear\" to hf_flashinfer_mla.absorption.KNOWN_LINEARS"),
}


@pytest.mark.parametrize("change", list(AFTER_ABSORBING))
def test_decode_follows_what_the_module_computes_after_it_changes(change, monkeypatch, caplog):
    """After a first absorbed generate(), each kv_b_proj gets a hook, a pruning mask, a parametrization or state of
    its own: the next generate() gives eager's tokens and logits (eager runs the module itself). Where no absorbed
    weight can follow the module, decode runs through it, with one warning saying why."""
    modify, warning = AFTER_ABSORBING[change]
    model = make_model("deepseek_v3", dtype=torch.float64)
    ids, mask, prompts = left_padded_batch(lengths=(7, 4, 9))
    calls = _count_reference_calls(monkeypatch)

    def run():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)

    run()
    assert calls  # absorbed
    for m in _attention_modules(model):
        modify(m.kv_b_proj)
    calls.clear()
    with caplog.at_level(logging.WARNING, logger="hf_flashinfer_mla"):
        out = run()
    assert_batch_matches_eager_alone(model, out, prompts, NEW_TOKENS, tol=1e-6)
    warned = [r.getMessage() for r in caplog.records if r.name == "hf_flashinfer_mla" and "kv_b_proj" in r.getMessage()]
    if warning is None:
        assert calls and not warned
    else:
        assert not calls and len(warned) == 1 and warning in warned[0]


@pytest.mark.filterwarnings("ignore:For backward hooks to be called:UserWarning")
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
@pytest.mark.parametrize("hook", ["module", "every-module"])
def test_backward_hooks_on_kv_b_proj_run_in_a_short_training_forward(hook, monkeypatch, caplog):
    """A full backward hook on kv_b_proj (here one that zeroes its input's gradient), or one for every module
    (``register_module_full_backward_hook``), in a training forward short enough for the absorbed path (<= 8
    tokens): eager runs kv_b_proj, so its hook fires and shapes the gradients. The absorbed path never calls the
    module, so with gradients enabled it decodes through the module, with one warning, and gives eager's gradients
    and hook calls; under no_grad (generate()) the hooks never fire and the decode stays absorbed."""
    ids = torch.randint(1, 90, (2, 6), generator=torch.Generator().manual_seed(5))
    grads, fired = {}, {}
    calls = _count_reference_calls(monkeypatch)
    for attn in ("flashinfer_mla", "eager"):
        model = make_model("deepseek_v3", attn=attn)
        model.train()
        seen = []

        def zero_grad_input(mod, grad_in, grad_out, seen=seen):
            if mod.__class__ is nn.Linear and getattr(mod, "_probe_kv_b", False):
                seen.append(1)
                return tuple(None if g is None else torch.zeros_like(g) for g in grad_in)
            return None

        for m in _attention_modules(model):
            m.kv_b_proj._probe_kv_b = True
            if hook == "module":
                m.kv_b_proj.register_full_backward_hook(zero_grad_input)
        handle = (torch.nn.modules.module.register_module_full_backward_hook(zero_grad_input)
                  if hook == "every-module" else None)
        try:
            with caplog.at_level(logging.WARNING, logger="hf_flashinfer_mla"):
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        finally:
            if handle is not None:
                handle.remove()
        grads[attn] = [m.kv_a_proj_with_mqa.weight.grad.clone() for m in _attention_modules(model)]
        fired[attn] = len(seen)
    assert fired["eager"] == len(grads["eager"]) and fired["flashinfer_mla"] == fired["eager"]
    for a, b in zip(grads["flashinfer_mla"], grads["eager"]):
        assert rel_err(a, b) < 1e-6
    warned = [r.getMessage() for r in caplog.records if "backward hooks" in r.getMessage()]
    assert len(warned) == 1 and not calls  # (the reference attention over the absorbed latent never ran)


def test_a_biased_kv_b_proj_with_attention_sinks_decodes_as_eager(caplog):
    """HY-V4's attention sinks share each query's softmax mass without a value. A kv_b_proj bias then does not
    factor out: its key half shifts every score against the sink's logit, its value half is weighted by the mass
    outside the sink. Such a layer decodes through kv_b_proj, with one warning, and gives eager's logits (the
    absorbed path dropped the key bias and added the value bias in full: rel err 0.1)."""
    model = make_model("hy_v4", dtype=torch.float32)
    g = torch.Generator().manual_seed(6)
    for m in _attention_modules(model):
        old = m.kv_b_proj
        m.kv_b_proj = nn.Linear(old.in_features, old.out_features, bias=True, dtype=old.weight.dtype)
        with torch.no_grad():
            m.kv_b_proj.weight.copy_(old.weight)
            m.kv_b_proj.bias.copy_(torch.randn(old.out_features, generator=g) * 0.5)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 9))
    outs = {}
    for attn in ("flashinfer_mla", "eager"):
        model.set_attn_implementation(attn)
        with caplog.at_level(logging.WARNING, logger="hf_flashinfer_mla"):
            outs[attn] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                        do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(outs["flashinfer_mla"].sequences, outs["eager"].sequences)
    assert rel_err(torch.stack(outs["flashinfer_mla"].logits), torch.stack(outs["eager"].logits)) < 1e-5
    warned = [r.getMessage() for r in caplog.records if "attention sinks, with which" in r.getMessage()]
    assert len(warned) == 1


def test_weights_offloaded_by_accelerate_decode_through_the_module(caplog):
    """accelerate's CPU offload leaves the weights on the meta device and loads them inside each module's forward:
    decode runs through kv_b_proj (one warning) and gives eager's logits, where reading the weight would fail."""
    from accelerate import cpu_offload

    model = make_model("deepseek_v3", dtype=torch.float64)
    ids = torch.randint(1, 90, (2, 7), generator=torch.Generator().manual_seed(3))
    forced = torch.randint(1, 90, (2, 4), generator=torch.Generator().manual_seed(4))
    expected = decode_logits(model, ids, torch.ones_like(ids), forced=forced)
    cpu_offload(model, execution_device=torch.device("cpu"))
    assert _attention_modules(model)[0].kv_b_proj.weight.is_meta
    with caplog.at_level(logging.WARNING, logger="hf_flashinfer_mla"):
        assert rel_err(decode_logits(model, ids, torch.ones_like(ids), forced=forced), expected) < 1e-12
    assert sum("offloaded" in r.getMessage() for r in caplog.records) == 1
