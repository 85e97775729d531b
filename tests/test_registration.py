"""Registration, switching implementations, backend forcing, absorption bookkeeping and the documented errors."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers import VOCAB, decode_logits, left_padded_batch, make_config, make_model, rel_err
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

import hf_flashinfer_mla
from hf_flashinfer_mla import absorption, attention, paged_cache
from hf_flashinfer_mla.capabilities import ENV_VAR, requested_backend
from hf_flashinfer_mla.errors import BackendUnavailableError, CacheLayoutError, UnsupportedModelError


def _decode_logits(model, steps=3, **kwargs):
    # Unpadded: eager in float64 turns the fully masked rows of a left-padded prefill into NaN (see shared NOTES).
    ids, mask, _ = left_padded_batch(lengths=(5, 5))
    return decode_logits(model, ids, mask, steps=steps, **kwargs)


def _load(path_or_config, **kwargs):
    kwargs = dict(attn_implementation="flashinfer_mla", dtype=torch.float64, experts_implementation="eager", **kwargs)
    if isinstance(path_or_config, transformers.PreTrainedConfig):
        return transformers.AutoModelForCausalLM.from_config(path_or_config, **kwargs)
    return transformers.AutoModelForCausalLM.from_pretrained(path_or_config, **kwargs)


def test_import_registers_attention_and_mask_functions():
    assert AttentionInterface._global_mapping["flashinfer_mla"] is attention.flashinfer_mla_attention_forward
    assert "flashinfer_mla" in AttentionMaskInterface._global_mapping


def test_register_is_idempotent():
    before = PreTrainedModel._check_and_adjust_attn_implementation
    hf_flashinfer_mla.register()
    hf_flashinfer_mla.register()
    after = PreTrainedModel._check_and_adjust_attn_implementation
    assert after is before
    assert not getattr(after.__wrapped__, "_flashinfer_mla_patch", False)  # wrapped exactly once
    make_model("deepseek_v3")
    make_model("deepseek_v3")
    expand_kv = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention.expand_kv
    assert expand_kv._flashinfer_mla_hook and not hasattr(expand_kv.__wrapped__, "_flashinfer_mla_hook")
    # Continuous batching's allocators: our stand-ins, each over Transformers' own class (never over itself).
    from transformers.generation.continuous_batching import cache as cb_cache

    assert cb_cache.ATTN_TYPE_TO_ALLOCATOR[paged_cache.FULL_ATTENTION] is paged_cache.FullOrLatentAllocator
    assert paged_cache.FullOrLatentAllocator.__bases__ == (cb_cache.FullAttentionCacheAllocator,)
    if paged_cache.TRANSFORMERS_MLA_ALLOCATOR is not None:  # Transformers 5.25+
        assert cb_cache.MLACacheAllocator is paged_cache.MLAOrLatentAllocator
        assert paged_cache.MLAOrLatentAllocator.__bases__ == (paged_cache.TRANSFORMERS_MLA_ALLOCATOR,)
        assert not paged_cache.TRANSFORMERS_MLA_ALLOCATOR.__name__.startswith("LatentOr")


def test_every_seam_of_the_table_is_in_place_once():
    """Each row of `registration.SEAMS` names what Transformers holds now: the package's wrapper, put there once (its
    original underneath is Transformers' own), or nothing where this release lacks an optional seam's object (5.25's
    `MLACacheAllocator` on 5.24); and the table names every wrapper once per place."""
    from hf_flashinfer_mla import registration

    places = [(id(seam.owner), seam.name) for seam in registration.SEAMS]
    assert len(set(places)) == len(places)
    hf_flashinfer_mla.register()
    for seam in registration.SEAMS:
        table = isinstance(seam.owner, dict)
        current = seam.owner.get(seam.name) if table else getattr(seam.owner, seam.name, None)
        if current is None:
            assert seam.optional, seam
            continue
        assert getattr(current, registration.PATCHED, False), seam
        original = getattr(getattr(current, "__func__", current), "__wrapped__", None)
        if original is None:  # (a class in Transformers' place: over Transformers' own, never over itself)
            assert not current.__bases__[0].__name__.startswith("LatentOr"), seam
        else:
            assert not getattr(original, registration.PATCHED, False), seam
        assert seam.versions and seam.why, seam


def test_switching_back_and_forth_gives_each_implementations_own_result():
    model = make_model("deepseek_v2")
    results = {}
    for attn in ["eager", "flashinfer_mla", "sdpa", "eager", "flashinfer_mla", "sdpa"]:
        model.set_attn_implementation(attn)
        assert model.config._attn_implementation == attn
        results.setdefault(attn, []).append(_decode_logits(model))
    for attn, (first, second) in results.items():
        assert torch.equal(first, second), attn
    # They agree with each other only to rounding (different arithmetic), and the expanded path is really back:
    assert rel_err(results["flashinfer_mla"][0], results["eager"][0]) < 1e-6
    assert not torch.equal(results["flashinfer_mla"][0], results["eager"][0])


def test_from_pretrained_and_backend_keyword(tmp_path):
    make_model("deepseek_v3").save_pretrained(tmp_path)
    model = _load(tmp_path, mla_backend="reference")
    assert model.config._attn_implementation == "flashinfer_mla"
    assert requested_backend(None, model.config) == "reference"
    eager = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float64, experts_implementation="eager"
    )
    assert rel_err(_decode_logits(model), _decode_logits(eager)) < 1e-6


@pytest.mark.parametrize("load", ["from_pretrained", "from_config"])
def test_load_option_is_a_runtime_setting_not_saved(tmp_path, monkeypatch, load):
    source = tmp_path / "source"
    make_model("deepseek_v3").save_pretrained(source)
    model = _load(source if load == "from_pretrained" else make_config("deepseek_v3"), mla_backend="fa3")
    # Forced at load: the decode fails on this CPU machine, naming the backend ...
    with pytest.raises(BackendUnavailableError, match="'fa3'.*NVIDIA GPU"):
        _decode_logits(model, steps=1)
    # ... a call-time keyword beats it, and it beats the environment.
    reference = _decode_logits(model, mla_backend="reference")
    monkeypatch.setenv(ENV_VAR, "reference")
    with pytest.raises(BackendUnavailableError, match="'fa3'"):
        _decode_logits(model, steps=1)
    # It is not part of the checkpoint: neither config.json nor generation_config.json name it, and the reloaded
    # model decodes on this machine with the environment's choice.
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    for name in ("config.json", "generation_config.json"):
        assert "mla_backend" not in (saved / name).read_text(), name
    assert "mla_backend" not in repr(model.config)
    reloaded = _load(saved)
    assert requested_backend(None, reloaded.config) == "reference"
    assert torch.equal(_decode_logits(reloaded), reference)


def test_checkpoint_saved_with_a_backend_does_not_force_it(tmp_path, monkeypatch):
    # A config.json that names a backend (as this package wrote before it kept the option off the config): ignored.
    make_model("deepseek_v3").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mla_backend": "fa3"}))
    model = _load(tmp_path)
    assert requested_backend(None, model.config) == "auto"
    monkeypatch.setenv(ENV_VAR, "reference")
    assert requested_backend(None, model.config) == "reference"
    _decode_logits(model, steps=2)


def test_unknown_backend_fails_at_the_call_that_passes_it(tmp_path, monkeypatch):
    make_model("deepseek_v3").save_pretrained(tmp_path)
    model = _load(tmp_path)
    ids = torch.randint(1, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    model.generate(input_ids=ids, max_new_tokens=1)  # control: the calls below fail for the bad value only
    # generate() with one new token runs the prefill only: no decode step would ever look at the backend.
    for call, source in [
        (lambda: _load(tmp_path, mla_backend="fa4"), "from_pretrained"),
        (lambda: _load(make_config("deepseek_v3"), mla_backend="fa4"), "from_config"),
        (lambda: model.generate(input_ids=ids, max_new_tokens=1, mla_backend="fa4"), "mla_backend= of this call"),
    ]:
        with pytest.raises(BackendUnavailableError, match=rf"unknown flashinfer_mla backend 'fa4' \(from {source}"):
            call()
    monkeypatch.setenv(ENV_VAR, "fa4")
    for call in (lambda: _load(tmp_path), lambda: model.generate(input_ids=ids, max_new_tokens=1)):
        with pytest.raises(BackendUnavailableError, match=r"'fa4' \(from \$HF_FLASHINFER_MLA_BACKEND\)"):
            call()


def test_generate_keyword_reaches_every_layer_and_beats_the_load_option():
    model = _load(make_config("deepseek_v3"), mla_backend="fa2")
    ids, mask, _ = left_padded_batch(lengths=(4,))
    with pytest.raises(BackendUnavailableError, match="'fa2'"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2)
    forced = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                            mla_backend="reference")
    model.set_attn_implementation("eager")
    assert torch.equal(forced, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False))


def test_unsupported_models_are_refused_at_load_time():
    llama = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(UnsupportedModelError, match="not one.*Supported model types: deepseek_v2"):
        transformers.AutoModelForCausalLM.from_config(llama, attn_implementation="flashinfer_mla")
    model = transformers.AutoModelForCausalLM.from_config(llama, attn_implementation="eager")
    with pytest.raises(UnsupportedModelError):
        model.set_attn_implementation("flashinfer_mla")
    assert model.config._attn_implementation == "eager"


def test_forcing_an_impossible_backend_is_a_clear_error(monkeypatch):
    model = make_model("deepseek_v3")
    with pytest.raises(BackendUnavailableError, match="'fa3'.*NVIDIA GPU"):
        _decode_logits(model, steps=1, mla_backend="fa3")
    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", "trtllm-gen")
    with pytest.raises(BackendUnavailableError, match="trtllm-gen"):
        _decode_logits(model, steps=1)
    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", "fa4")
    with pytest.raises(BackendUnavailableError, match="unknown"):
        _decode_logits(model, steps=1)
    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", "reference")
    ref = _decode_logits(model, steps=2)
    monkeypatch.delenv("HF_FLASHINFER_MLA_BACKEND")
    assert torch.equal(ref, _decode_logits(model, steps=2, mla_backend="reference"))
    # The keyword also travels through generate() to every layer.
    ids, mask, _ = left_padded_batch(lengths=(4,))
    with pytest.raises(BackendUnavailableError):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, mla_backend="fa2")


def test_cache_that_does_not_hold_the_latent_is_refused():
    model = make_model("deepseek_v3")
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 1, attn.qk_head_dim, dtype=torch.float64)
    expanded_k = torch.randn(1, 4, 6, attn.qk_head_dim, dtype=torch.float64)
    expanded_v = torch.randn(1, 4, 6, attn.v_head_dim, dtype=torch.float64)
    mask = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    with pytest.raises(CacheLayoutError, match="expects the cache to return the MLA latent"):
        attention.flashinfer_mla_attention_forward(attn, q, expanded_k, expanded_v, mask, scaling=attn.scaling)
    latent = torch.randn(1, 1, 6, attn.kv_lora_rank, dtype=torch.float64)
    rot = torch.randn(1, 1, 6, attn.qk_rope_head_dim, dtype=torch.float64)
    with pytest.raises(CacheLayoutError, match="continuous batching"):
        attention.flashinfer_mla_attention_forward(attn, q, latent, rot, None, scaling=attn.scaling)
    with pytest.raises(UnsupportedModelError):
        attention.flashinfer_mla_attention_forward(torch.nn.Linear(2, 2), q, latent, rot, mask)
