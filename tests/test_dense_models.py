"""flashinfer_mla against Transformers' eager attention, on small random models of every dense MLA family in float64
(CPU; the registry is ``helpers.FAMILIES``).

The oracle is each prompt generated *alone* (unpadded) with ``eager``: a left-padded eager batch in float64 is
itself not exact (eager turns its fully masked left-padding rows into NaN), so batched flashinfer_mla must reproduce
the unpadded runs. Several families cast to float32 internally (RMSNorm everywhere, KDA state updates in the
hybrids), so the observed error is float32-ulp sized (~1e-7), still well under the 1e-6 bound.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    VOCAB, assert_batch_matches_eager_alone, chained_generate, decode_logits, eager_alone, early_eos, eos_generate,
    kv_b_proj_rows, left_padded_batch, make_model, mla_layers, rel_err, set_attention,
)
from transformers import DynamicCache, StaticCache

import hf_flashinfer_mla
from hf_flashinfer_mla import plan
from hf_flashinfer_mla.kernels import reference

NEW_TOKENS = 6
TOL = 1e-6


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_batched_generate_matches_eager_alone(model_type, cache_implementation):
    model = make_model(model_type)
    ids, mask, prompts = left_padded_batch()
    # Rows pushed through kv_b_proj: the prefill expands the latent once, the decode steps must not (absorbed path),
    # so this also shows that the comparison below exercises the absorbed decode and not only the expanded prefill.
    with kv_b_proj_rows(model) as rows:
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
            return_dict_in_generate=True, cache_implementation=cache_implementation,
        )
    if cache_implementation == "dynamic":
        assert sum(rows) == ids.numel() * len(mla_layers(model))
    assert_batch_matches_eager_alone(model, out, prompts, NEW_TOKENS, TOL)


@pytest.mark.parametrize("cache_kind", ["dynamic", "static", "latent"])
def test_teacher_forced_16_decode_steps(model_type, cache_kind):
    model = make_model(model_type)
    ids, mask, prompts = left_padded_batch()
    forced = torch.randint(1, VOCAB, (len(prompts), 16), generator=torch.Generator().manual_seed(5))
    if cache_kind == "static":
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 20)
    elif cache_kind == "latent":
        cache = hf_flashinfer_mla.MLALatentCache(config=model.config)
    else:
        cache = DynamicCache(config=model.config)
    ours = decode_logits(model, ids, mask, cache, forced=forced)
    for i, ref in enumerate(eager_alone(model, prompts, forced)):
        assert rel_err(ours[i], ref) < TOL


def test_prompt_lookup_decoding_matches_eager(model_type):
    """Prompt-lookup decoding in every family: each forward verifies up to 3 drafted tokens (decode steps of several
    query tokens) and rejected drafts crop the cache. From Transformers 5.25 this includes the hybrids (kimi_linear,
    bailing_hybrid), whose caches mix the latent layers with linear-attention states: 5.24 refused assisted decoding
    for them. The oracle is eager in the same mode on the same model (5.25's eager gives a small Kimi-Linear other
    tokens than its plain greedy decoding, in float64 too, a Transformers matter: the package must give eager's)."""
    model = make_model(model_type)
    if getattr(model, "_is_stateful", False):  # (the flag and the refusal went together in 5.25)
        pytest.skip(f"this Transformers refuses assisted decoding for {type(model).__name__}")
    motif = torch.randint(1, VOCAB, (4,), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([motif, motif, motif, motif[:2]])[None]  # repetitive, so drafts are found
    kwargs = dict(do_sample=False, prompt_lookup_num_tokens=3, max_new_tokens=10, output_logits=True,
                  return_dict_in_generate=True)
    ours = model.generate(ids, **kwargs)
    set_attention(model, "eager")
    ref = model.generate(ids, **kwargs)
    assert torch.equal(ours.sequences, ref.sequences)
    assert rel_err(torch.cat(ours.logits), torch.cat(ref.logits)) < TOL


def test_multi_token_decode_is_absorbed_and_matches_eager(model_type, monkeypatch):
    """Chunks of 2, 3 and 8 query tokens per sequence (speculative/assisted decoding) take the absorbed path: no
    cached row goes through kv_b_proj, the latent attention sees all the chunk's queries, and the logits equal eager."""
    model = make_model(model_type)
    ids, mask, prompts = left_padded_batch()
    chunks = (2, 3, 8)
    forced = torch.randint(1, VOCAB, (len(prompts), sum(chunks)), generator=torch.Generator().manual_seed(7))
    queries = []
    original = reference.mla_attention_reference

    def spy(q_lat, *args, **kwargs):
        queries.append(q_lat.shape[2])
        return original(q_lat, *args, **kwargs)

    monkeypatch.setattr(reference, "mla_attention_reference", spy)
    with kv_b_proj_rows(model) as rows:
        ours = decode_logits(model, ids, mask, forced=forced, chunks=chunks)
    layers = mla_layers(model)
    assert sum(rows) == ids.numel() * len(layers)  # the prefill's expansion (so the count works), nothing after it
    assert queries == [n for n in chunks for _ in layers]  # every chunk reached the latent attention of every layer
    for i, ref in enumerate(eager_alone(model, prompts, forced, chunks=chunks)):
        assert rel_err(ours[i], ref) < TOL


def test_decode_never_expands_cached_rows(model_type):
    model = make_model(model_type)
    ids, mask, _ = left_padded_batch()
    cache = DynamicCache(config=model.config)
    layers = len(mla_layers(model))
    with kv_b_proj_rows(model) as rows:
        decode_logits(model, ids, mask, cache, steps=3)
        assert sum(rows) == ids.numel() * layers  # the prefill expands once; the 3 decode steps do not
        rows.clear()
        # The same count does see the history re-expanded under eager: the count above is not vacuous.
        model.set_attn_implementation("eager")
        mask = torch.ones(ids.shape[0], ids.shape[1] + 4, dtype=torch.long)
        model(input_ids=ids[:, -1:], attention_mask=mask, cache=cache, use_cache=True)
        assert sum(rows) == ids.shape[0] * (ids.shape[1] + 4) * layers


def test_step_plan_built_once_per_forward_step(monkeypatch):
    model = make_model("deepseek_v3", num_hidden_layers=3)
    built = []
    original = plan.StepPlan.__init__

    def counting_init(self, mask, *args, **kwargs):
        built.append(mask.shape)
        original(self, mask, *args, **kwargs)

    monkeypatch.setattr(plan.StepPlan, "__init__", counting_init)
    ids, mask, _ = left_padded_batch()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    # 4 decode steps after the prefill (whose 9-token query takes the expanded path), 3 layers each: one plan a step,
    # and one for the step after the last, planned while the last one ran (generate() stops there).
    assert len(built) == 4 + 1


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


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_rows_finishing_early_at_eos_match_eager(cache_implementation):
    """A left-padded batch whose rows stop at different steps: the eos token is the one row 1 generates third, so
    that row finishes early and is padded while the others decode on (float32, batched eager is exact there)."""
    model = make_model("deepseek_v3", dtype=torch.float32)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 9))
    model.set_attn_implementation("eager")
    eos = early_eos(model, ids, mask)
    ref = eos_generate(model, ids, mask, eos, cache_implementation)
    model.set_attn_implementation("flashinfer_mla")
    ours = eos_generate(model, ids, mask, eos, cache_implementation)
    new = ref.sequences[:, ids.shape[1]:]
    assert (new[1, 2] == eos) and bool((new[1, 3:] == 0).all()) and not bool((new[0] == eos).any()), new.tolist()
    assert torch.equal(ours.sequences, ref.sequences)
    assert len(ours.logits) == len(ref.logits) == new.shape[1]
    assert rel_err(torch.stack(ours.logits), torch.stack(ref.logits)) < 1e-5


def test_generate_continued_over_its_cache_with_new_tokens_and_holes_matches_eager():
    """Four chained generate() calls on one left-padded batch, each continuing the previous call's cache
    (`helpers.chained_generate`): with three new tokens per row; with new tokens of different lengths per row,
    padded where they join the history (holes in the 2D mask, which the step's rows then carry); with one new token.
    Batched eager in float32 is the oracle."""
    model = make_model("deepseek_v3", dtype=torch.float32)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 9))
    model.set_attn_implementation("eager")
    ref = chained_generate(model, ids, mask)
    model.set_attn_implementation("flashinfer_mla")
    for i, (ours, theirs) in enumerate(zip(chained_generate(model, ids, mask), ref)):
        assert torch.equal(ours.sequences, theirs.sequences), i
        assert rel_err(torch.stack(ours.logits), torch.stack(theirs.logits)) < 1e-5, i


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


@pytest.mark.parametrize("built_by", ["forward", "user"])
def test_caches_built_for_the_model_grow_in_place_and_decode_as_eager(built_by):
    """A `DynamicCache` built from the model's config gets `MLALatentLayer`s wherever it is built: by the model's
    forward when it is called without a cache (a loop of the user's own; classifier-free guidance's forward inside
    generate()), or by the user. Transformers' DynamicLayer concatenates, copying every layer's whole history on
    every step; these grow in place, and their decode equals eager's. A cache built without the config, or for a
    model running another implementation, keeps Transformers' own layers."""
    model = make_model("deepseek_v3")
    ids, mask, prompts = left_padded_batch()
    forced = torch.randint(1, VOCAB, (len(prompts), 5), generator=torch.Generator().manual_seed(6))
    seen = []
    model.model.register_forward_hook(lambda module, args, kwargs, out: seen.append(out.cache), with_kwargs=True)
    ours = decode_logits(model, ids, mask, cache=DynamicCache(config=model.config) if built_by == "user" else None,
                         forced=forced)
    cache = seen[0]
    assert all(c is cache for c in seen) and type(cache) is DynamicCache
    assert all(type(layer) is hf_flashinfer_mla.MLALatentLayer for layer in cache.layers)
    # (grown in place: the prefill's buffer still holds every decoded token)
    assert all(layer.capacity >= ids.shape[1] + forced.shape[1] for layer in cache.layers)
    for b, theirs in enumerate(eager_alone(model, prompts, forced)):
        assert rel_err(ours[b], theirs) < TOL
    assert not DynamicCache().layers  # (no config: Transformers' own layers, made as the model writes)
    model.set_attn_implementation("sdpa")
    assert not any(isinstance(layer, hf_flashinfer_mla.MLALatentLayer)
                   for layer in DynamicCache(config=model.config).layers)


@torch.no_grad()
def test_a_prompt_cache_copied_and_continued_matches_eager():
    """Transformers' recipe for reusing a prompt's cache: prefill a shared prefix once into a `DynamicCache`, then for
    each continuation ``generate()`` from a ``copy.deepcopy`` of it. The copies (of `MLALatentLayer`s: their views
    into the copied buffers) must decode as eager's copies of its own layers do, and leave the prefix cache as it
    was for the next continuation."""
    import copy

    model = make_model("deepseek_v3")
    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(1, VOCAB, (1, 7), generator=g)
    suffixes = [torch.randint(1, VOCAB, (1, n), generator=g) for n in (3, 5)]
    runs = {}
    for attn in ("flashinfer_mla", "eager"):
        model.set_attn_implementation(attn)
        prompt_cache = model(input_ids=prefix, cache=DynamicCache(config=model.config), use_cache=True).cache
        runs[attn] = [model.generate(input_ids=torch.cat([prefix, s], dim=-1), cache=copy.deepcopy(prompt_cache),
                                     max_new_tokens=4, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True) for s in suffixes]
        assert prompt_cache.get_seq_length() == prefix.shape[1]
    assert type(runs["flashinfer_mla"][0].cache.layers[0]) is hf_flashinfer_mla.MLALatentLayer
    for ours, theirs in zip(runs["flashinfer_mla"], runs["eager"]):
        assert torch.equal(ours.sequences, theirs.sequences)
        assert rel_err(torch.stack(ours.logits), torch.stack(theirs.logits)) < TOL


# ---------------------------------------- what code relies on from DynamicLayer: it never writes a tensor it handed out
@torch.no_grad()
def test_a_snapshot_taken_before_a_crop_is_restored_as_eager():
    """A snapshot of the cache's tensors at a branch point (``list(cache)``), a crop further back to try another
    branch, then the snapshot restored (``DynamicCache(ddp_cache_data=...)``) and continued. Transformers' layers
    concatenate into new tensors, so the snapshot still holds the branch point; the latent layers must not write
    over the rows it covers (the other branch's update copies them first)."""
    model = make_model("deepseek_v3")
    prompt = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    logits = {}
    for attn in ("flashinfer_mla", "eager"):
        model.set_attn_implementation(attn)
        cache = model(input_ids=prompt, use_cache=True).cache
        snapshot = [(k, v) for k, v, *_ in cache]
        cache.crop(-2)
        model(input_ids=torch.tensor([[40, 41]]), cache=cache, use_cache=True)  # the other branch
        restored = DynamicCache(ddp_cache_data=snapshot)
        logits[attn] = model(input_ids=torch.tensor([[7]]), cache=restored, use_cache=True).logits
    assert rel_err(logits["flashinfer_mla"], logits["eager"]) < TOL


@torch.no_grad()
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_cache_saved_and_loaded_continues_as_eager(how):
    """A prompt's cache pickled or saved with ``torch.save``, loaded, and continued: the loaded latent layers are
    the prompt's, and their views are their own (a copy holds no reference to what the original handed out)."""
    import io
    import pickle

    model = make_model("deepseek_v3")
    prompt = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    logits = {}
    for attn in ("flashinfer_mla", "eager"):
        model.set_attn_implementation(attn)
        cache = model(input_ids=prompt, use_cache=True).cache
        if how == "pickle":
            loaded = pickle.loads(pickle.dumps(cache))
        else:
            buffer = io.BytesIO()
            torch.save(cache, buffer)
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=False)
        logits[attn] = model(input_ids=torch.tensor([[7, 8], [9, 10]]), cache=loaded, use_cache=True).logits
        assert cache.get_seq_length() == 9 and loaded.get_seq_length() == 11
    assert rel_err(logits["flashinfer_mla"], logits["eager"]) < TOL


def test_gradients_through_two_forwards_over_one_cache_match_eager():
    """Training over a sequence in two chunks that share a cache, the loss of both backpropagated: autograd saved
    the first chunk's cached latent, which the second chunk's update must not write over (it copies it, as
    DynamicLayer's concatenation does), and the gradients are eager's."""
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(9))
    grads = {}
    for attn in ("flashinfer_mla", "eager"):
        model = make_model("deepseek_v3")
        model.set_attn_implementation(attn)
        first = model(input_ids=ids[:, :7], labels=ids[:, :7], use_cache=True)
        second = model(input_ids=ids[:, 7:], labels=ids[:, 7:], cache=first.cache, use_cache=True)  # (decode-sized)
        (first.loss + second.loss).backward()
        grads[attn] = [p.grad for p in (model.model.layers[0].self_attn.kv_b_proj.weight,
                                        model.model.embed_tokens.weight)]
    for ours, theirs in zip(grads["flashinfer_mla"], grads["eager"]):
        assert rel_err(ours, theirs) < TOL


def test_a_cache_prefilled_in_inference_mode_is_continued_outside_it():
    """A prompt cache prefilled under ``torch.inference_mode()`` and continued by ``generate()`` (which runs under
    ``no_grad``): inference tensors cannot be written outside inference mode, so the latent layers copy them into
    new buffers at the first update outside, and the tokens and logits are eager's. Inside generate() the later steps
    write in place (the cache's storage stays the same)."""
    model = make_model("deepseek_v3")
    prompt = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    ids = torch.cat([prompt, torch.tensor([[5, 6]])], -1)
    runs, storages = {}, []
    for attn in ("flashinfer_mla", "eager"):
        model.set_attn_implementation(attn)
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=prompt, cache=cache, use_cache=True)
        hook = model.model.layers[0].self_attn.register_forward_hook(
            lambda *_: storages.append(cache.layers[0].keys.untyped_storage().data_ptr()))
        runs[attn] = model.generate(input_ids=ids, cache=cache, max_new_tokens=4, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
        hook.remove()
        if attn == "flashinfer_mla":
            assert len(storages) == 4 and len(set(storages)) == 1, storages  # one copy before the first, then in place
    assert torch.equal(runs["flashinfer_mla"].sequences, runs["eager"].sequences)
    assert rel_err(torch.stack(runs["flashinfer_mla"].logits), torch.stack(runs["eager"].logits)) < TOL
    assert len(set(storages[4:])) == 4  # (eager's layers: a new tensor every step)


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
    ours = decode_logits(model, ids, mask, forced=forced)
    for i, ref in enumerate(eager_alone(model, prompts, forced)):
        assert rel_err(ours[i], ref) < TOL


def test_a_cache_continued_after_the_model_moves_to_float64_matches_eager():
    """generate() in float32, ``model.to(torch.float64)``, then generate() over the same cache: Transformers' layers
    promote the cached float32 rows when float64 ones join them (``torch.cat``), so the latent layers do too (the
    float32 buffers took the float64 rows cast down, and the decode failed on mixed dtypes)."""
    ids, mask, _ = left_padded_batch()
    logits = {}
    for attn in ("flashinfer_mla", "eager"):
        model = make_model("deepseek_v3", attn=attn, dtype=torch.float32)
        first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                               return_dict_in_generate=True)
        model.to(torch.float64)
        longer = torch.cat([mask, torch.ones(mask.shape[0], 3, dtype=mask.dtype)], dim=-1)
        out = model.generate(input_ids=first.sequences, attention_mask=longer, cache=first.cache, max_new_tokens=4,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        assert out.cache.layers[0].keys.dtype == torch.float64
        logits[attn] = torch.stack(out.logits)
    assert rel_err(logits["flashinfer_mla"], logits["eager"]) < 1e-5  # (eager's softmax runs in float32)


def test_multi_token_prediction_drafts_and_verifies_as_eager(monkeypatch):
    """``generate(use_mtp=True)``: Transformers builds an ``MtpModel`` over the main model's config, attention
    implementation included, and drafts with it. Its class has no attention of its own (its layers are the main
    model's decoder layers, already hooked): it runs flashinfer_mla (its construction is not refused) and gives
    eager's tokens and logits. (``MtpModel.from_pretrained`` reads a checkpoint's MTP weights; here the MTP
    layers are built from the main model, with random weights, through the same constructor.)"""
    from transformers.modeling_layers import MtpModel

    def built_from_the_main_model(cls, main_model, **kwargs):
        torch.manual_seed(123)
        mtp = cls(main_model, main_model.config.get_text_config().num_mtp_layers)
        with torch.no_grad():
            for name, p in mtp.named_parameters():
                if "proj" in name:
                    p.normal_(0, 0.05)
        return mtp.to(main_model.dtype).eval()

    monkeypatch.setattr(MtpModel, "from_pretrained", classmethod(built_from_the_main_model))
    model = make_model("deepseek_v3", dtype=torch.float32, num_mtp_layers=2)
    prompt = torch.tensor([[5, 9, 33, 2, 71, 40, 12, 8, 19]])
    outs = {}
    for attn in ("flashinfer_mla", "eager"):
        set_attention(model, attn)
        outs[attn] = model.generate(input_ids=prompt, max_new_tokens=10, use_mtp=True, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
    assert torch.equal(outs["flashinfer_mla"].sequences, outs["eager"].sequences)
    assert rel_err(torch.stack(outs["flashinfer_mla"].logits), torch.stack(outs["eager"].logits)) < 1e-5
