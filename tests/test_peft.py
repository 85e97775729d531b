"""PEFT LoRA adapters on ``kv_b_proj``, the matrix that absorbed decode folds into the query and the output.

A LoRA-wrapped ``kv_b_proj`` is not a plain ``nn.Linear``: absorbed decode needs the dense matrix the wrapper
computes, which depends on more than the module's tensors: which adapter is active (``set_adapter``), whether
adapters are disabled (``disable_adapter()``), whether one is merged into the base weight (``merge_adapter`` /
``unmerge_adapter``). Every decode must use the matrix of the adapter state *at that step*, in one process, on one
model, however often the state changes.

The oracle is Transformers' ``eager`` on the same PEFT model in the same adapter state (the attention is switched
through the PEFT wrapper: ``peft_model.set_attn_implementation("eager")`` reaches the base model). The batch is
unpadded where eager runs batched in float64 (eager turns fully masked left-padding rows into NaN in float64, see
shared NOTES); ``generate()`` runs a left-padded batch in float32, where batched eager is exact.

Every inference decode here runs under ``torch.no_grad()`` (as generate() does) with 1-token steps: the absorbed
path, which the tests check by counting the cached rows pushed through ``kv_b_proj`` (only the prefill's).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from helpers import (BNB_RANK, VOCAB, decode_logits, kv_b_proj_rows, kv_b_proj_to_4bit, left_padded_batch, make_model, mla_layers,
                     rel_err)
from transformers import DynamicCache

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

# peft 0.21 calls Transformers' deprecated `is_gradient_checkpointing`: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

TOL64 = 1e-6
TOL32 = 1e-5
STEPS = 4  # 1-token decode steps after the prefill
# PEFT warns about adapter names contained in its "lora_" prefix ("a" is), so the two adapters are named in full.
FIRST, SECOND = "first", "second"


def lora_config() -> LoraConfig:
    # init_lora_weights=False: random A and B, so that each adapter really changes kv_b_proj (the default B = 0 would
    # make every adapter state compute the same thing and hide a stale matrix).
    return LoraConfig(target_modules=["kv_b_proj"], r=4, lora_alpha=8, init_lora_weights=False, task_type="CAUSAL_LM")


def peft_model(model_type: str, dtype=torch.float64):
    """A tiny model of `model_type` with two random LoRA adapters on kv_b_proj, FIRST active."""
    model = make_model(model_type, dtype=dtype)
    torch.manual_seed(100)
    pm = get_peft_model(model, lora_config(), adapter_name=FIRST)
    torch.manual_seed(101)
    pm.add_adapter(SECOND, lora_config())
    assert pm.active_adapter == FIRST
    return pm.eval()


def with_eager(pm, fn):
    """``fn()`` with eager attention on the same PEFT model (switched back to flashinfer_mla afterwards)."""
    pm.set_attn_implementation("eager")
    assert pm.get_base_model().config._attn_implementation == "eager"
    try:
        return fn()
    finally:
        pm.set_attn_implementation("flashinfer_mla")


def inputs(lengths=(9, 9, 9)):
    ids, mask, _ = left_padded_batch(lengths=lengths)
    forced = torch.randint(1, VOCAB, (len(lengths), STEPS), generator=torch.Generator().manual_seed(5))
    return ids, mask, forced


def decode_vs_eager(pm, ids, mask, forced) -> tuple[float, float, torch.Tensor]:
    """Teacher-forced decode (prefill + `STEPS` 1-token steps) with flashinfer_mla and with eager, in the model's
    current adapter state: ``(relative error, max abs difference, flashinfer_mla's logits)``. Also checks that the
    flashinfer_mla decode steps were absorbed (no cached row through kv_b_proj after the prefill)."""
    with torch.no_grad(), kv_b_proj_rows(pm) as rows:
        ours = decode_logits(pm, ids, mask, forced=forced)
    assert sum(rows) == ids.numel() * len(mla_layers(pm)), "decode steps expanded the cache instead of being absorbed"
    with torch.no_grad():
        ref = with_eager(pm, lambda: decode_logits(pm, ids, mask, forced=forced))
    return rel_err(ours, ref), (ours - ref).abs().max().item(), ours


def adapter_states(pm):
    """Walk one PEFT model through its adapter states, in this order, yielding ``(name, context)`` with the model in
    that state (the context is entered around the decode: `disable_adapter` is a context manager)."""
    tuner = pm.base_model  # the LoRA tuner: its set_adapter also takes a list of adapters
    yield FIRST, nullcontext()
    pm.set_adapter(SECOND)
    yield SECOND, nullcontext()
    yield "disabled", pm.disable_adapter()
    pm.set_adapter(FIRST)
    yield f"{FIRST} again", nullcontext()
    tuner.set_adapter([FIRST, SECOND])
    yield f"{FIRST}+{SECOND}", nullcontext()
    tuner.set_adapter(FIRST)
    pm.merge_adapter()
    yield f"{FIRST} merged", nullcontext()
    pm.unmerge_adapter()
    yield f"{FIRST} unmerged", nullcontext()
    pm.set_adapter(SECOND)
    pm.merge_adapter()
    yield f"{SECOND} merged", nullcontext()
    pm.unmerge_adapter()
    yield f"{SECOND} unmerged", nullcontext()


def test_peft_model_switches_attention_through_the_wrapper():
    """``set_attn_implementation`` called on the PeftModel reaches the base model (and comes back), which the other
    tests rely on for their eager oracle."""
    pm = peft_model("deepseek_v3")
    assert pm.get_base_model().config._attn_implementation == "flashinfer_mla"
    pm.set_attn_implementation("eager")
    assert pm.get_base_model().config._attn_implementation == "eager"
    pm.set_attn_implementation("flashinfer_mla")
    assert pm.get_base_model().config._attn_implementation == "flashinfer_mla"


def test_adapter_states_decode_like_eager(model_type):
    """Teacher-forced decode in every adapter state of one PEFT model, one after the other: adapter FIRST,
    ``set_adapter(SECOND)``, ``disable_adapter()``, back to FIRST, both adapters active, ``merge_adapter()``,
    ``unmerge_adapter()``, then SECOND merged and unmerged. Each equals eager in the same state (float64).

    Guards against absorbed decode keeping the kv_b_proj matrix of an earlier adapter state (a dense copy
    re-derived only when some parameter tensor changes: switching, disabling or combining adapters changes no
    tensor). Every state is checked before failing, so the message lists each state that is wrong.
    """
    pm = peft_model(model_type)
    ids, mask, forced = inputs()
    results, outputs = {}, {}
    for name, context in adapter_states(pm):
        with context:
            results[name] = decode_vs_eager(pm, ids, mask, forced)
        outputs[name] = results[name][2]
    assert len(results) == 9
    wrong = {name: f"rel {r:.2g}, max |diff| {d:.3g}" for name, (r, d, _) in results.items() if not r < TOL64}
    assert not wrong, f"flashinfer_mla differs from eager in adapter states {wrong}"
    # The states really differ (else the comparisons above could not catch a stale matrix), and merging does not
    # change what an adapter computes.
    assert rel_err(outputs[FIRST], outputs[SECOND]) > 1e-2
    assert rel_err(outputs[FIRST], outputs["disabled"]) > 1e-2
    assert rel_err(outputs[FIRST], outputs[f"{FIRST}+{SECOND}"]) > 1e-2
    assert rel_err(outputs[f"{FIRST} merged"], outputs[FIRST]) < TOL64
    assert rel_err(outputs[f"{SECOND} merged"], outputs[SECOND]) < TOL64


def generate32(pm, ids, mask):
    return pm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=STEPS + 1, do_sample=False,
                       output_logits=True, return_dict_in_generate=True)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_adapter_states_generate_like_eager(model_type):
    """``generate()`` through the PEFT model on a left-padded batch (float32), adapter FIRST, then SECOND, then with
    adapters disabled, then FIRST merged: tokens and logits equal batched eager's in the same state. Guards against
    a stale kv_b_proj matrix reaching generate()'s decode steps."""
    pm = peft_model(model_type, dtype=torch.float32)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 9))
    wrong = {}

    def check(name):
        ours = generate32(pm, ids, mask)
        ref = with_eager(pm, lambda: generate32(pm, ids, mask))
        errs = [rel_err(a, b) for a, b in zip(ours.logits, ref.logits)]
        if not (max(errs) < TOL32 and torch.equal(ours.sequences, ref.sequences)):
            diff = max((a - b).abs().max().item() for a, b in zip(ours.logits, ref.logits))
            wrong[name] = f"max |logit diff| {diff:.3g}, tokens equal: {torch.equal(ours.sequences, ref.sequences)}"

    check(FIRST)
    pm.set_adapter(SECOND)
    check(SECOND)
    with pm.disable_adapter():
        check("disabled")
    pm.set_adapter(FIRST)
    pm.merge_adapter()
    check(f"{FIRST} merged")
    pm.unmerge_adapter()
    assert not wrong, f"flashinfer_mla generate() differs from eager in adapter states {wrong}"


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed:UserWarning")
@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_lora_bias_decodes_like_eager(model_type):
    """``LoraConfig(lora_bias=True)`` gives each adapter's ``lora_B`` a bias, which PEFT's forward adds (scaled) and
    ``get_delta_weight`` leaves out: the derived matrix carries it as a bias of its value half, through adapter
    switches, disabling and two adapters at once, so decode equals eager's in every state (it ignored the bias)."""
    model = make_model(model_type)
    config = dict(target_modules=["kv_b_proj"], r=4, lora_alpha=8, init_lora_weights=False, task_type="CAUSAL_LM",
                  lora_bias=True)
    torch.manual_seed(100)
    pm = get_peft_model(model, LoraConfig(**config), adapter_name=FIRST)
    torch.manual_seed(101)
    pm.add_adapter(SECOND, LoraConfig(**config))
    pm.eval()
    with torch.no_grad():  # biases large enough to matter (PEFT initialises lora_B's bias to zero)
        for m in mla_layers(pm):
            for name in (FIRST, SECOND):
                m.kv_b_proj.lora_B[name].bias.normal_(0, 0.5)
    ids, mask, forced = inputs()
    errs, outs = {}, {}
    for name, context in [(FIRST, nullcontext()), (SECOND, nullcontext()), ("disabled", pm.disable_adapter()),
                          ("both", nullcontext())]:
        if name == SECOND:
            pm.set_adapter(SECOND)
        if name == "both":
            pm.base_model.set_adapter([FIRST, SECOND])
        with context:
            errs[name], _, outs[name] = decode_vs_eager(pm, ids, mask, forced)
    assert all(e < TOL64 for e in errs.values()), errs
    assert rel_err(outs[FIRST], outs[SECOND]) > 1e-2 and rel_err(outs["both"], outs[FIRST]) > 1e-2


# ------------------------------------------------------------------------------------------------------- training
def lora_grads(pm) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in pm.named_parameters() if p.requires_grad}


def train_step_loss(pm, ids, mask, forced) -> torch.Tensor:
    """A training-mode forward: prefill, then one 1-token decode step on the cache, under autograd; the loss is the
    cross-entropy of the decode step's prediction plus the prefill's (so the gradient flows through both)."""
    cache = DynamicCache(config=pm.get_base_model().config)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    pre = pm(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    step_mask = torch.cat([mask, torch.ones_like(forced[:, :1])], dim=-1)
    out = pm(input_ids=forced[:, :1], attention_mask=step_mask, position_ids=mask.sum(-1, keepdim=True), cache=cache,
             use_cache=True)
    loss = torch.nn.functional.cross_entropy(out.logits[:, -1], forced[:, 1])
    return loss + torch.nn.functional.cross_entropy(pre.logits[:, -1], forced[:, 0])


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_training_through_lora_gives_eager_gradients(model_type):
    """Train mode, LoRA parameters requiring grad, a prefill then a 1-token decode step under ``torch.enable_grad``:
    the loss and the gradient of every LoRA parameter equal eager's (float64). Guards against the decode step
    detaching kv_b_proj (a derived copy carries no gradient to the adapter) or using a stale matrix. Then one SGD
    step changes the adapter in place, and the next (inference) decode must use the updated adapter."""
    pm = peft_model(model_type)
    pm.train()
    trainable = [p for p in pm.parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n, p in pm.named_parameters() if p.requires_grad)
    ids, mask, forced = inputs()

    def loss_and_grads():
        pm.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss = train_step_loss(pm, ids, mask, forced)
            loss.backward()
        return loss.detach(), lora_grads(pm)

    loss, grads = loss_and_grads()
    ref_loss, ref_grads = with_eager(pm, loss_and_grads)
    assert rel_err(loss, ref_loss) < TOL64
    assert set(grads) == set(ref_grads) and len(grads) == len(trainable)
    for name, g in grads.items():
        assert g.abs().max() > 0, f"{name}: no gradient"
        assert rel_err(g, ref_grads[name]) < TOL64, f"{name}: gradient differs from eager's"

    # One optimizer step updates the LoRA weights in place; inference decode must see the new adapter.
    before = decode_vs_eager(pm.eval(), ids, mask, forced)[2]
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if p.requires_grad:
                p.sub_(0.5 * grads[name])
    rel, diff, after = decode_vs_eager(pm, ids, mask, forced)
    assert rel < TOL64, f"after an optimizer step: max |diff| {diff:.3g} to eager"
    assert rel_err(after, before) > 1e-3  # the step really changed the adapter


@torch.no_grad()
def test_reassigned_weight_data_is_seen_and_its_old_memory_let_go():
    """``weight.data = new`` on the LoRA's base bumps no version counter: the base's views are keyed on the
    weight's storage, so the next decode sees the new weight, and lets the old weight's memory go (as for a plain
    kv_b_proj: the views of the last decode hold it until the layer decodes again)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    pm = peft_model("deepseek_v3")
    ids, mask, forced = inputs()
    decode_vs_eager(pm, ids, mask, forced)  # absorbs each layer's base
    g = torch.Generator().manual_seed(7)
    replaced = []
    for rounds in range(1, 4):
        for _ in range(rounds):  # several in a row with no decode between
            for m in mla_layers(pm):
                w = m.kv_b_proj.base_layer.weight
                replaced.append(StorageWeakRef(w.untyped_storage()))
                w.data = torch.randn(w.shape, dtype=w.dtype, generator=g) * 0.05
        assert decode_vs_eager(pm, ids, mask, forced)[0] < TOL64, rounds
        assert all(ref.expired() for ref in replaced)


def test_a_model_made_under_inference_mode_decodes_absorbed_and_follows_every_edit(caplog):
    """Inference tensors keep no version counter, so an in-place edit leaves no trace; nothing absorbed decode
    reads of a LoRA layer is derived from them (the base's views and the adapters' factors are read at each step),
    so such a model decodes absorbed, without a warning, and follows every in-place edit of base and adapter."""
    import logging

    with torch.inference_mode():
        pm = peft_model("deepseek_v3")
        ids, mask, forced = inputs()
        with caplog.at_level(logging.WARNING, logger="hf_flashinfer_mla"):
            outs = []
            for edit in range(3):
                with kv_b_proj_rows(pm) as rows:
                    outs.append(decode_logits(pm, ids, mask, forced=forced))
                assert sum(rows) == ids.numel() * len(mla_layers(pm)), "decode expanded the cache"
                ref = with_eager(pm, lambda: decode_logits(pm, ids, mask, forced=forced))
                assert rel_err(outs[-1], ref) < TOL64, edit
                for m in mla_layers(pm):
                    m.kv_b_proj.base_layer.weight.mul_(1.5)
                    m.kv_b_proj.lora_B[FIRST].weight.mul_(2.0)
    assert rel_err(outs[0], outs[1]) > 1e-3 and rel_err(outs[1], outs[2]) > 1e-3  # each edit changed the model
    assert not [r for r in caplog.records if "kv_b_proj" in r.getMessage()]


def test_a_batch_of_several_adapters_decodes_like_eager():
    """``generate(adapter_names=[...])`` serves each row with its own adapter (or the base model), through forward
    hooks PEFT puts on the LoRA layers for the call: those rows decode through the module, with one warning."""
    pm = peft_model("deepseek_v3", dtype=torch.float32)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 9))
    names = [FIRST, "__base__", SECOND]

    def run():
        return pm.generate(input_ids=ids, attention_mask=mask, adapter_names=names, max_new_tokens=5,
                           do_sample=False, output_logits=True, return_dict_in_generate=True)

    ours, ref = run(), with_eager(pm, run)
    assert torch.equal(ours.sequences, ref.sequences)
    assert rel_err(torch.stack(ours.logits), torch.stack(ref.logits)) < TOL32
    # back to one adapter for the whole batch: absorbed again
    assert decode_vs_eager(pm, *inputs())[0] < TOL64


def test_train_mode_dropout_draws_what_eager_draws():
    """A LoRA with dropout in train mode is not linear, and the package probes that on the identity basis: the probe
    runs on a forked random state, so a seeded generate() draws the same dropout masks as eager's."""
    model = make_model("deepseek_v3", dtype=torch.float64)
    torch.manual_seed(100)
    config = LoraConfig(target_modules=["kv_b_proj"], r=4, lora_alpha=8, lora_dropout=0.3, init_lora_weights=False)
    pm = get_peft_model(model, config).train()
    ids = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))

    def run():
        torch.manual_seed(0)
        with torch.no_grad():
            return pm.generate(input_ids=ids, max_new_tokens=6, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)

    ours, ref = run(), with_eager(pm, run)
    assert torch.equal(ours.sequences, ref.sequences)
    assert rel_err(torch.stack(ours.logits), torch.stack(ref.logits)) < TOL64


@pytest.mark.parametrize("tuner", ["ia3", "loha"])
def test_other_tuners_decode_through_the_module_even_when_named_known(tuner, monkeypatch, caplog):
    """PEFT's other tuners (IA3, LoHa, ...) switch adapters by plain attributes, as LoRA does, but the package only
    knows LoRA's switches: they decode through the module, with one warning that does not suggest trusting them,
    and follow ``disable_adapter()``. Listing their bare class name ("Linear", as the warning once suggested) in
    KNOWN_LINEARS does not make the package trust them (it gave rel err 0.19 inside ``disable_adapter()``)."""
    import logging

    from hf_flashinfer_mla import absorption

    monkeypatch.setattr(absorption, "KNOWN_LINEARS", absorption.KNOWN_LINEARS | {"Linear"})
    torch.manual_seed(100)
    config = (peft.IA3Config(target_modules=["kv_b_proj"], feedforward_modules=[]) if tuner == "ia3"
              else peft.LoHaConfig(target_modules=["kv_b_proj"], r=4, init_weights=False))
    pm = get_peft_model(make_model("deepseek_v3"), config).eval()
    with torch.no_grad():  # (IA3 starts as the identity: move it off)
        for n, p in pm.named_parameters():
            if tuner == "ia3" and "ia3_l" in n:
                p.add_(torch.randn_like(p) * 0.5)
    ids, mask, forced = inputs()
    with caplog.at_level(logging.WARNING, logger="hf_flashinfer_mla"):
        for context in (nullcontext(), pm.disable_adapter(), nullcontext()):
            with context, torch.no_grad():
                ours = decode_logits(pm, ids, mask, forced=forced)
                assert rel_err(ours, with_eager(pm, lambda: decode_logits(pm, ids, mask, forced=forced))) < TOL64
    warned = [r.getMessage() for r in caplog.records if "kv_b_proj" in r.getMessage()]
    assert len(warned) == 1 and "peft.tuners" in warned[0] and "KNOWN_LINEARS" not in warned[0]


# ------------------------------------------------------------------------------------ weights written in place
HOTSWAP_TARGETS = {"kv_b_proj": ["kv_b_proj"], "with q_b_proj and o_proj": ["kv_b_proj", "q_b_proj", "o_proj"]}


def _swapped_in_adapter(targets, tmp_path, seed: int):
    """A second LoRA of the same shape as FIRST (other random factors, the same alpha: only tensors change) on the same base model,
    saved as PEFT saves adapters: ``(its directory, its state dict, its config)``."""
    config = LoraConfig(target_modules=targets, r=4, lora_alpha=8, init_lora_weights=False, task_type="CAUSAL_LM")
    base = make_model("deepseek_v3")
    torch.manual_seed(seed)  # (after make_model, which seeds its own weights)
    other = get_peft_model(base, config, adapter_name=FIRST)
    other.save_pretrained(tmp_path, selected_adapters=[FIRST])
    path = tmp_path / FIRST if (tmp_path / FIRST).exists() else tmp_path
    # (hotswap_adapter_from_state_dict takes the model's own keys, adapter name included)
    state = {k: v.clone() for k, v in other.state_dict().items() if f"lora_A.{FIRST}." in k or f"lora_B.{FIRST}." in k}
    return path, state, config


@pytest.mark.parametrize("source", ["directory", "state dict"])
@pytest.mark.parametrize("targets", list(HOTSWAP_TARGETS), ids=list(HOTSWAP_TARGETS))
def test_a_hot_swapped_adapter_decodes_like_eager(targets, source, tmp_path):
    """PEFT's hot-swap (``hotswap_adapter`` from a saved adapter, ``hotswap_adapter_from_state_dict``) copies the
    new factors into the live adapter's tensors with ``.data.copy_``, which moves no version counter and changes no
    attribute: prefill and every decode step must use the new adapter, as eager does."""
    from peft.utils.hotswap import hotswap_adapter, hotswap_adapter_from_state_dict

    targets = HOTSWAP_TARGETS[targets]
    config = LoraConfig(target_modules=targets, r=4, lora_alpha=8, init_lora_weights=False, task_type="CAUSAL_LM")
    base = make_model("deepseek_v3")
    torch.manual_seed(100)
    pm = get_peft_model(base, config, adapter_name=FIRST).eval()
    ids, mask, forced = inputs()
    err, _, before = decode_vs_eager(pm, ids, mask, forced)  # the old adapter, absorbed once already
    assert err < TOL64
    path, state, new_config = _swapped_in_adapter(targets, tmp_path, seed=200)
    if source == "directory":
        hotswap_adapter(pm, str(path), adapter_name=FIRST)
    else:
        hotswap_adapter_from_state_dict(pm, state, adapter_name=FIRST, config=new_config)
    err, _, after = decode_vs_eager(pm, ids, mask, forced)
    assert rel_err(after, before) > 1e-3, "the swap did not change the model: the test would prove nothing"
    assert err < TOL64


def test_a_data_write_to_lora_b_between_generate_calls_is_followed():
    """A write through ``lora_B.weight.data`` (what PEFT's hot-swap and hand-made swaps do) between two
    ``generate()`` calls: the second call gives eager's tokens for the new factors."""
    pm = peft_model("deepseek_v3", dtype=torch.float32)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 9))

    def run():
        return pm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                           output_logits=True, return_dict_in_generate=True)

    first = run()
    assert torch.equal(first.sequences, with_eager(pm, run).sequences)
    g = torch.Generator().manual_seed(9)
    for m in mla_layers(pm):
        b = m.kv_b_proj.lora_B[FIRST].weight
        b.data.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype) * 2.0)
    ours, ref = run(), with_eager(pm, run)
    assert not torch.equal(torch.stack(first.logits), torch.stack(ref.logits)), "the write changed nothing"
    assert torch.equal(ours.sequences, ref.sequences)
    assert rel_err(torch.stack(ours.logits), torch.stack(ref.logits)) < TOL32


def test_a_lora_over_a_4bit_base_follows_its_adapter_as_written():
    """QLoRA: a LoRA over a bitsandbytes 4-bit kv_b_proj. The base is absorbed through its dequantized copy, the
    adapter live on top: a ``.data`` write to the adapter's factors is followed at the next step, as eager does."""
    model = make_model("deepseek_v3", dtype=torch.float32, kv_lora_rank=BNB_RANK)
    kv_b_proj_to_4bit(model)
    torch.manual_seed(100)
    pm = get_peft_model(model, lora_config(), adapter_name=FIRST).eval()
    assert type(mla_layers(pm)[0].kv_b_proj.base_layer).__name__ == "Linear4bit"
    ids, mask, forced = inputs()
    err, _, before = decode_vs_eager(pm, ids, mask, forced)
    assert err < TOL32 * 10
    g = torch.Generator().manual_seed(9)
    for m in mla_layers(pm):
        a = m.kv_b_proj.lora_A[FIRST].weight
        a.data.copy_(torch.randn(a.shape, generator=g, dtype=a.dtype))
    err, _, after = decode_vs_eager(pm, ids, mask, forced)
    assert rel_err(after, before) > 1e-3, "the write changed nothing"
    assert err < TOL32 * 10


def test_a_compiled_decode_step_follows_a_hot_swap_without_recompiling():
    """The point of hot-swapping: a compiled decode step (one graph, as CUDA graphs need) reads the new adapter's
    factors after ``hotswap_adapter_from_state_dict``, as the same steps uncompiled do, without compiling again."""
    from peft.utils.hotswap import hotswap_adapter_from_state_dict
    from transformers import StaticCache

    torch._dynamo.reset()
    # Dense layers only: the MoE's eager experts have data-dependent shapes that no decode graph can hold.
    base = make_model("deepseek_v3", dtype=torch.float32, first_k_dense_replace=2)
    torch.manual_seed(100)
    pm = get_peft_model(base, lora_config(), adapter_name=FIRST).eval()
    model = pm.get_base_model()
    ids, mask, _ = left_padded_batch()

    def steps(forward, n=3):
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + n + 2)
        m, pos = mask, (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=m, position_ids=pos, cache=cache, use_cache=True)
            logits = []
            for _ in range(n):
                m, pos = torch.cat([m, torch.ones_like(m[:, :1])], -1), pos[:, -1:] + 1
                out = forward(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=m, position_ids=pos,
                              cache=cache, use_cache=True)
                logits.append(out.logits)
        return torch.cat(logits, 1)

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
    before = steps(compiled)
    assert rel_err(before, steps(model)) < TOL32
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(11)
    state = {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in pm.state_dict().items()
             if f"lora_B.{FIRST}." in k or f"lora_A.{FIRST}." in k}
    hotswap_adapter_from_state_dict(pm, state, adapter_name=FIRST, config=lora_config())
    after = steps(compiled)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames, "the hot-swap recompiled"
    assert rel_err(after, before) > 1e-3, "the swap changed nothing"
    assert rel_err(after, steps(model)) < TOL32
