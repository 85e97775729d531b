"""flashinfer_mla against Transformers' eager attention, on small random models in float64 (CPU).

The oracle is each prompt generated *alone* (unpadded) with ``eager``: a left-padded eager batch in float64 is
itself not exact (see shared NOTES), so batched flashinfer_mla must reproduce the unpadded runs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    VOCAB, assert_batch_matches_eager_alone, left_padded_batch, make_model, rel_err, teacher_forced_logits,
)
from transformers import DynamicCache, StaticCache

import hf_flashinfer_mla
from hf_flashinfer_mla import metadata

NEW_TOKENS = 6
TOL = 1e-6


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_batched_generate_matches_eager_alone(model_type, cache_implementation):
    model = make_model(model_type)
    ids, mask, prompts = left_padded_batch()
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
        return_dict_in_generate=True, cache_implementation=cache_implementation,
    )
    assert_batch_matches_eager_alone(model, out, prompts, NEW_TOKENS, TOL)


@pytest.mark.parametrize("cache_kind", ["dynamic", "static", "latent"])
def test_teacher_forced_16_decode_steps(model_type, cache_kind):
    model = make_model(model_type)
    ids, mask, prompts = left_padded_batch()
    forced = torch.randint(1, VOCAB, (len(prompts), 16), generator=torch.Generator().manual_seed(5))

    def new_cache(batch):
        if cache_kind == "static":
            return StaticCache(config=model.config, max_cache_len=ids.shape[1] + 20)
        if cache_kind == "latent":
            return hf_flashinfer_mla.MLALatentCache(config=model.config)
        return DynamicCache(config=model.config)

    ours = teacher_forced_logits(model, ids, mask, forced, new_cache(len(prompts)))
    model.set_attn_implementation("eager")
    for i, p in enumerate(prompts):
        ref = teacher_forced_logits(model, p[None], torch.ones(1, len(p), dtype=torch.long), forced[i : i + 1],
                                     DynamicCache(config=model.config))
        assert rel_err(ours[i], ref[0]) < TOL


def test_decode_never_expands_cached_rows(model_type):
    model = make_model(model_type)
    rows = []
    hooks = [
        m.kv_b_proj.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[:-1].numel()))
        for m in model.modules() if hasattr(m, "kv_b_proj")
    ]
    ids, mask, _ = left_padded_batch()
    out = model(input_ids=ids, attention_mask=mask, cache=DynamicCache(config=model.config), use_cache=True)
    prefill_rows = sum(rows)
    assert prefill_rows == ids.numel() * model.config.num_hidden_layers  # prefill expands once
    rows.clear()
    for _ in range(3):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        out = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask, cache=out.cache, use_cache=True)
    assert sum(rows) == 0
    # The same hook does see the history re-expanded under eager: the count above is not vacuous.
    model.set_attn_implementation("eager")
    model(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask[:, :1]], -1), cache=out.cache, use_cache=True)
    assert sum(rows) == ids.shape[0] * (ids.shape[1] + 4) * model.config.num_hidden_layers
    for h in hooks:
        h.remove()


def test_step_plan_built_once_per_forward_step(monkeypatch):
    model = make_model("deepseek_v3", num_hidden_layers=3)
    built = []
    original = metadata.StepPlan.__init__

    def counting_init(self, mask):
        built.append(mask.shape)
        original(self, mask)

    monkeypatch.setattr(metadata.StepPlan, "__init__", counting_init)
    ids, mask, _ = left_padded_batch()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    # 4 decode steps after the prefill (whose 9-token query takes the expanded path), 3 layers each: one plan a step.
    assert len(built) == 4


def test_generate_again_on_the_same_cache():
    model = make_model("deepseek_v3")
    ids, mask, prompts = left_padded_batch(lengths=(5, 8))
    first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                           return_dict_in_generate=True)
    seq = first.sequences
    mask2 = torch.cat([mask, torch.ones(seq.shape[0], 3, dtype=mask.dtype)], -1)
    second = model.generate(input_ids=seq, attention_mask=mask2, cache=first.cache, max_new_tokens=3,
                            do_sample=False)
    model.set_attn_implementation("eager")
    for i, p in enumerate(prompts):
        alone = model.generate(input_ids=p[None], max_new_tokens=6, do_sample=False)
        assert torch.equal(second[i, -6:], alone[0, -6:])


def test_beam_search_and_sampling_match_eager():
    model = make_model("deepseek_v2")
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    results = {}
    for attn in ("flashinfer_mla", "eager"):
        model.set_attn_implementation(attn)
        beams = model.generate(input_ids=prompt, max_new_tokens=5, num_beams=3, num_return_sequences=2,
                               do_sample=False)
        torch.manual_seed(11)
        sampled = model.generate(input_ids=prompt, max_new_tokens=5, do_sample=True, top_k=20,
                                 num_return_sequences=3)
        results[attn] = (beams, sampled)
    assert torch.equal(results["flashinfer_mla"][0], results["eager"][0])
    assert torch.equal(results["flashinfer_mla"][1], results["eager"][1])


def test_use_cache_false_matches_eager():
    model = make_model("deepseek_v3")
    ids, mask, prompts = left_padded_batch(lengths=(5, 3))
    ours = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=False)
    model.set_attn_implementation("eager")
    for i, p in enumerate(prompts):
        alone = model.generate(input_ids=p[None], max_new_tokens=4, do_sample=False, use_cache=False)
        assert torch.equal(ours[i, -4:], alone[0, -4:])


def test_short_chunk_forward_without_cache_matches_eager():
    # A <= MAX_DECODE_QUERY-token forward takes the absorbed path even without a cache (causal within the chunk).
    model = make_model("glm4_moe_lite")
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    ours = model(input_ids=ids, use_cache=False).logits
    model.set_attn_implementation("eager")
    assert rel_err(ours, model(input_ids=ids, use_cache=False).logits) < TOL


def test_generate_uses_latent_cache_by_default_and_accepts_explicit_caches():
    model = make_model("deepseek_v3")
    ids, mask, _ = left_padded_batch(lengths=(4, 6))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, return_dict_in_generate=True)
    assert all(isinstance(layer, hf_flashinfer_mla.MLALatentLayer) for layer in out.cache.layers)
    explicit = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2,
                              cache=hf_flashinfer_mla.MLALatentCache(config=model.config))
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2,
                           cache=DynamicCache(config=model.config))
    assert torch.equal(explicit, out.sequences) and torch.equal(plain, out.sequences)
    # Other implementations keep Transformers' own DynamicLayer.
    model.set_attn_implementation("sdpa")
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, return_dict_in_generate=True)
    assert not any(isinstance(layer, hf_flashinfer_mla.MLALatentLayer) for layer in out.cache.layers)


def test_right_padded_batch_matches_eager_alone():
    # Right padding leaves a hole between the prompt and the generated tokens: the decode mask is not one run.
    model = make_model("deepseek_v3")
    lengths = (7, 4, 9)
    _, _, prompts = left_padded_batch(lengths=lengths)
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, : len(p)], mask[i, : len(p)] = p, 1
    forced = torch.randint(1, VOCAB, (len(prompts), 5), generator=torch.Generator().manual_seed(6))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=DynamicCache(config=model.config),
                use_cache=True)
    pos = mask.sum(-1, keepdim=True) - 1
    ours = []
    for t in range(forced.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        pos = pos + 1
        out = model(input_ids=forced[:, t : t + 1], attention_mask=mask, position_ids=pos, cache=out.cache,
                    use_cache=True)
        ours.append(out.logits[:, -1])
    ours = torch.stack(ours, 1)
    model.set_attn_implementation("eager")
    for i, p in enumerate(prompts):
        ref = teacher_forced_logits(model, p[None], torch.ones(1, len(p), dtype=torch.long), forced[i : i + 1],
                                     DynamicCache(config=model.config))
        assert rel_err(ours[i], ref[0]) < TOL
