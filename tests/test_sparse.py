"""Sparse MLA (DeepSeek Sparse Attention): every DSA family of the installed Transformers, against ``eager``.

DSA models hand ``flashinfer_mla`` the indexer's selection as ``indices=`` and fold nothing into its mask, so an
implementation that ignores them attends densely: the tiny models here have an ``index_topk`` below their
prompts' lengths, so that the selection changes the result, and one test proves it does (the same comparison with
the selection ignored fails). The oracle is Transformers' ``eager`` on the same weights (the same model object,
switched back and forth): batched in float32, and in float64 each row alone (eager's padded float64 is NaN).
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    DSA_FAMILIES, VOCAB, decode_logits, eager_alone, kv_b_proj_rows, left_padded_batch, make_model, mla_layers,
    rel_err, set_attention, with_4d_masks,
)

from hf_flashinfer_mla import attention, masks
from hf_flashinfer_mla.cache import MLAIndexedLayer
from hf_flashinfer_mla.kernels import reference

TOL32 = 1e-5
TOL64 = 1e-6
NEW_TOKENS = 8
MODES = {
    "greedy": dict(do_sample=False),
    "beams": dict(do_sample=False, num_beams=3),
    "sampling": dict(do_sample=True, top_k=8),
    "static": dict(do_sample=False, cache_implementation="static"),
}


# GLM-5-next's attention passes no `indices`: it folds its (pooled, -1 padded) selection into the additive mask it
# hands every implementation but sdpa, and builds its masks without the mask interface.
FOLDS_SELECTION_INTO_MASK = ("glm5_next",)


@pytest.fixture(params=list(DSA_FAMILIES))
def dsa_type(request):
    return request.param


def eager_twin(model, fn):
    set_attention(model, "eager")
    try:
        return fn()
    finally:
        set_attention(model, "flashinfer_mla")


def _generate(model, ids, mask, **kwargs):
    torch.manual_seed(7)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, output_logits=True,
                          return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("mode", list(MODES))
def test_generate_matches_eager(dsa_type, mode):
    model = make_model(dsa_type, dtype=torch.float32)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 12))
    ours = _generate(model, ids, mask, **MODES[mode])
    ref = eager_twin(model, lambda: _generate(model, ids, mask, **MODES[mode]))
    assert torch.equal(ours.sequences, ref.sequences)
    worst = max(rel_err(a, b) for a, b in zip(ours.logits, ref.logits))
    assert worst < TOL32


def test_chunked_prefill_matches_eager(dsa_type):
    """Long prompts are prefilled in chunks (the indexer's prefill scores grow with prompt x context): each chunk
    of 5 tokens sees the cache of the chunks before it and folds its own selection into its mask."""
    model = make_model(dsa_type, dtype=torch.float32)
    ids = torch.randint(1, VOCAB, (2, 17), generator=torch.Generator().manual_seed(4))
    kwargs = dict(do_sample=False, max_new_tokens=6, prefill_chunk_size=5, output_logits=True,
                  return_dict_in_generate=True)
    ours = model.generate(ids, **kwargs)
    ref = eager_twin(model, lambda: model.generate(ids, **kwargs))
    assert torch.equal(ours.sequences, ref.sequences)
    assert max(rel_err(a, b) for a, b in zip(ours.logits, ref.logits)) < TOL32


def has_linear_attention(model) -> bool:
    """Whether the model has linear-attention (recurrent) layers: Transformers' `_is_stateful` flag up to 5.24, its
    layer types from 5.25 (which dropped the flag)."""
    return getattr(model, "_is_stateful", False) or "linear_attention" in (
        getattr(model.config.get_text_config(), "layer_types", None) or ())


def test_prompt_lookup_verifies_several_tokens_per_step(dsa_type):
    """Prompt-lookup decoding checks up to 3 drafted tokens per forward: decode steps of q_len > 1."""
    model = make_model(dsa_type, dtype=torch.float32)
    if getattr(model, "_is_stateful", False):  # GLM-5-next up to 5.24: Transformers refused assisted decoding
        pytest.skip(f"this Transformers has no assisted decoding for linear-attention layers ({type(model).__name__})")
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(1, VOCAB, (4,), generator=g)
    ids = torch.cat([motif, motif, motif, motif[:2]])[None]  # repetitive, so drafts are found
    kwargs = dict(do_sample=False, prompt_lookup_num_tokens=3, max_new_tokens=10)
    ours = model.generate(ids, **kwargs)
    assert torch.equal(ours, eager_twin(model, lambda: model.generate(ids, **kwargs)))


def test_each_row_matches_eager_alone_in_float64(dsa_type):
    model = make_model(dsa_type, dtype=torch.float64)
    ids, mask, prompts = left_padded_batch(lengths=(7, 4, 12))
    forced = torch.randint(1, VOCAB, (3, 10), generator=torch.Generator().manual_seed(2))
    ours = decode_logits(model, ids, mask, forced=forced, as_generate=True)
    for i, ref in enumerate(eager_alone(model, prompts, forced)):
        assert rel_err(ours[i], ref) < TOL64


@torch.no_grad()
def test_additive_masks_keep_their_bias_in_decode_and_in_longer_chunks(dsa_type):
    """4D float masks with an ALiBi-like bias, in decode steps (the selected rows' bias added to their scores) and in
    a chunk of 9 tokens (the selection folded into the float mask, which keeps its bias): eager's logits."""
    model = make_model(dsa_type, dtype=torch.float64)
    if has_linear_attention(model) or "sliding_attention" in getattr(model.config, "layer_types", ()):
        pytest.skip("Transformers' own eager fails on a user's 4D mask here (sliding-window layers reject it; "
                    "linear-attention layers give NaN in float64)")
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 2] = 0  # a hole in row 1's history
    forced = torch.randint(1, VOCAB, (2, 14), generator=torch.Generator().manual_seed(4))

    def run():
        return decode_logits(model, ids, mask, forced=forced, chunks=[1, 3, 9, 1], forward=with_4d_masks(model))

    assert rel_err(run(), eager_twin(model, run)) < TOL64


@torch.no_grad()
def test_a_mask_per_head_reaches_each_head_in_sparse_decode(dsa_type):
    """A 4D mask with a row per head (head h also hides position h): each head of a sparse decode step attends over
    its own row at the selected positions, as eager applies it."""
    model = make_model(dsa_type, dtype=torch.float64)
    if has_linear_attention(model) or "sliding_attention" in getattr(model.config, "layer_types", ()):
        pytest.skip("Transformers' own eager fails on a user's 4D mask here")
    heads = model.config.get_text_config().num_attention_heads
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    forced = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))

    def per_head(mask):
        mask = mask.repeat(1, heads, 1, 1)
        for h in range(heads):
            mask[:, h, :, h] = torch.finfo(mask.dtype).min
        return mask

    def run():
        return decode_logits(model, ids, torch.ones_like(ids), forced=forced, chunks=[1, 3, 1],
                             forward=with_4d_masks(model, "plain", per_head))

    assert rel_err(run(), eager_twin(model, run)) < TOL64


def test_the_selection_matters(dsa_type):
    """Control for the comparisons above: the same weights with an index_topk above every context (so no selection)
    give other logits, in eager itself, so matching eager means applying the selection."""
    forced = torch.randint(1, VOCAB, (3, 10), generator=torch.Generator().manual_seed(2))
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 12))
    logits = []
    for topk in (4, 64):
        model = make_model(dsa_type, dtype=torch.float32, **_topk(dsa_type, topk))
        logits.append(eager_twin(model, lambda: decode_logits(model, ids, mask, forced=forced)))
    assert rel_err(logits[0], logits[1]) > 100 * TOL32


def _topk(dsa_type, topk):
    """The config override for `index_topk` (GLM-5-next's lives in its text config)."""
    if dsa_type in ("glm5_next", "mistral_large4", "hy_v4_vl"):
        from helpers import DSA_FAMILIES as registry
        return {"text_config": {**registry[dsa_type][1]["text_config"], "index_topk": topk}}
    return {"index_topk": topk}


def test_ignoring_the_indices_fails_the_comparison(dsa_type, monkeypatch):
    """The attention function applies the `indices` it is given: with them ignored (dense attention in prefill and
    decode) the comparison with eager fails. The fault is injected where the sparse path runs, and the control
    checks it was reached."""
    if dsa_type in FOLDS_SELECTION_INTO_MASK:
        pytest.skip(f"{dsa_type} folds its selection into the mask it passes (no indices to ignore)")
    model = make_model(dsa_type, dtype=torch.float32)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 12))
    forced = torch.randint(1, VOCAB, (3, 10), generator=torch.Generator().manual_seed(2))
    ref = eager_twin(model, lambda: decode_logits(model, ids, mask, forced=forced))
    assert rel_err(decode_logits(model, ids, mask, forced=forced), ref) < TOL32
    reached = []

    def dense_decode(mask, indices, scale, *operands):
        reached.append("decode")
        return reference.attend(mask, scale, *operands)

    def dense_prefill(attention_mask, indices, kv_length):
        reached.append("prefill")
        return attention_mask

    monkeypatch.setattr(reference, "attend_sparse", dense_decode)
    monkeypatch.setattr(attention, "selection_mask", dense_prefill)
    dense = decode_logits(model, ids, mask, forced=forced)
    assert {"decode", "prefill"} <= set(reached)
    assert rel_err(dense, ref) > 100 * TOL32


def test_decode_never_expands_the_cached_history(dsa_type):
    """Decode reads kv_b_proj's weights (absorbed into the query and the output), never runs it over the cache;
    the same count under eager (which expands the history every step) proves the count sees the calls."""
    model = make_model(dsa_type, dtype=torch.float32)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 12))
    layers = len(mla_layers(model))
    forced = torch.ones(3, 4, dtype=torch.long)
    try:
        with kv_b_proj_rows(model) as calls:
            decode_logits(model, ids, mask, forced=forced)
            ours = len(calls) - layers  # the prefill expands once per layer
            set_attention(model, "eager")  # (hy_v4 has no sdpa; eager expands the history as sdpa does)
            calls.clear()
            decode_logits(model, ids, mask, forced=forced)
            eager = len(calls) - layers
    finally:
        set_attention(model, "flashinfer_mla")
    assert ours == 0 and eager == 4 * layers


def test_indexers_rank_hidden_positions_last(dsa_type, monkeypatch):
    """fa2/fa3 read only the first ``min(topk, visible)`` indices of each query token (planned on the host, no
    sync): that holds because Transformers' indexers take a sorted top-k of scores whose hidden positions are
    -inf. Checked on every decode layer's indices, so a change in an indexer turns this red before a GPU sees it."""
    if dsa_type in FOLDS_SELECTION_INTO_MASK:
        pytest.skip(f"{dsa_type} passes no indices")
    model = make_model(dsa_type, dtype=torch.float32)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 12))
    seen = []
    real = reference.attend_sparse

    def check(step_mask, indices, *args):
        b, sq, k = indices.shape
        visible = step_mask[:, 0].sum(-1)  # [B, Sq]
        counts = visible.clamp(max=k)
        rank = torch.arange(k)
        picked_visible = step_mask[:, 0].gather(2, indices.long().clamp_min(0)) & (indices >= 0)
        assert torch.equal(picked_visible, rank < counts[..., None])
        seen.append(k)
        return real(step_mask, indices, *args)

    monkeypatch.setattr(reference, "attend_sparse", check)
    decode_logits(model, ids, mask, forced=torch.randint(1, VOCAB, (3, 6)))
    assert seen


def test_selection_mask_matches_the_models_own_folding():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 1, 5, 9, generator=g) > 0.3
    indices = torch.stack([torch.randperm(9, generator=g)[:4] for _ in range(10)]).view(2, 5, 4).int()
    indices[0, 1, 3] = -1  # a padded pick selects nothing
    ours = masks.selection_mask(mask, indices, 9)
    keep = indices.clamp_min(0).long()
    expected = torch.zeros(2, 5, 9, dtype=torch.bool).scatter(-1, keep, True)
    expected[0, 1, keep[0, 1, 3]] = bool((indices[0, 1, :3] == keep[0, 1, 3]).any())
    assert torch.equal(ours, mask & expected[:, None])
    causal = masks.selection_mask(None, indices, 9)
    assert torch.equal(causal, torch.ones(5, 9, dtype=torch.bool).tril(4) & expected[:, None])


def test_indexed_layer_grows_both_caches_in_place():
    """The latent and the indexer keys grow together past the first capacity; views equal a concatenation."""
    layer = MLAIndexedLayer(packed=False)
    g = torch.Generator().manual_seed(0)
    lat, rope, keys = [], [], []
    for n in (9, 1, 300, 1, 1):  # the third update outgrows the first capacity (9 + 256, rounded)
        k, v, ik = (torch.randn(2, 1, n, 32, generator=g), torch.randn(2, 1, n, 8, generator=g),
                    torch.randn(2, n, 16, generator=g))
        layer.update(k, v)
        out = layer.update_indexer(ik)
        lat.append(k), rope.append(v), keys.append(ik)
        assert torch.equal(out, torch.cat(keys, 1)) and torch.equal(layer.keys, torch.cat(lat, 2))
    assert layer.capacity >= 312
    layer.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.indexer_keys, torch.cat(keys, 1).flip(0))
    layer.crop(-5)
    assert torch.equal(layer.indexer_keys, torch.cat(keys, 1).flip(0)[:, :-5])
    assert layer.get_seq_length() == 307


@torch.no_grad()
def test_indexer_keys_held_across_a_crop_are_not_overwritten(dsa_type):
    """A sparse layer's ``indexer_keys`` held across ``crop()`` and the next forward keeps its rows, as with
    Transformers' `DynamicIndexedLayer` (which concatenates into new tensors): the next forward copies the kept rows
    rather than write over the ones the held tensor covers. The logits after the other branch match eager's."""
    model = make_model(dsa_type, dtype=torch.float32)
    prompt = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    branch = torch.randint(1, VOCAB, (2, 2), generator=torch.Generator().manual_seed(4))
    logits = {}
    for attn in ("eager", "flashinfer_mla"):
        set_attention(model, attn)
        cache = model(input_ids=prompt, use_cache=True).cache
        held = [(i, layer.indexer_keys) for i, layer in enumerate(cache.layers)
                if getattr(layer, "indexer_keys", None) is not None]
        assert held, "the model's cache holds no indexer keys"
        before = [k.clone() for _, k in held]
        try:
            cache.crop(-2)
        except RuntimeError as e:  # (linear-attention and sliding layers record no past states by default)
            if attn == "eager":
                pytest.skip(f"{dsa_type}'s cache cannot crop with Transformers' own layers either: {e}")
            raise
        logits[attn] = model(input_ids=branch, cache=cache, use_cache=True).logits
        for (i, k), b in zip(held, before):
            assert torch.equal(k, b), f"{attn}: layer {i}'s held indexer_keys were overwritten"
    set_attention(model, "flashinfer_mla")
    assert rel_err(logits["flashinfer_mla"], logits["eager"]) < TOL32


def test_generate_uses_the_in_place_indexed_cache(dsa_type):
    model = make_model(dsa_type, dtype=torch.float32)
    ids, mask, _ = left_padded_batch()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                         return_dict_in_generate=True)
    kinds = {type(layer).__name__ for layer in out.cache.layers}
    assert "DynamicIndexedLayer" not in kinds and "MLAIndexedLayer" in kinds


def test_registry_covers_every_sparse_mla_type():
    from hf_flashinfer_mla import SPARSE_MLA_MODEL_TYPES
    from hf_flashinfer_mla.models import check_model_supported
    from helpers import make_config

    assert {check_model_supported(make_config(t)).model_type for t in DSA_FAMILIES} == set(SPARSE_MLA_MODEL_TYPES)
