"""flashinfer_mla against eager on the other dense MLA families: Mistral 4, LongCat-Flash, Youtu, A.X-K1, and the
hybrids Kimi-Linear and Bailing-hybrid (Ling), whose MLA layers are interleaved with KDA linear-attention layers.

Same oracle as ``test_models.py``: a left-padded batch generated with ``flashinfer_mla`` must reproduce each prompt
generated *alone* (unpadded) with ``eager``. Every model runs in float64 on CPU. Several of them cast to float32
internally (RMSNorm everywhere, KDA state updates in the hybrids), so the observed error is float32-ulp sized
(~1e-7), still well under the 1e-6 bound.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import COMMON, VOCAB, assert_batch_matches_eager_alone, left_padded_batch, rel_err, teacher_forced_logits
from transformers import DynamicCache, StaticCache
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import hf_flashinfer_mla

NEW_TOKENS = 6
TOL = 1e-6


_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
_MOE = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
            topk_group=1)
# Kimi-Linear and Bailing-hybrid name their MoE fields differently (num_experts, num_experts_per_token, ...).
_HYBRID_MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_token=2, num_shared_experts=1, n_group=1,
                   topk_group=1)

# model_type -> (causal-LM class, config kwargs). The causal-LM class is named explicitly because Transformers 5.24
# does not map mistral4 in AutoModelForCausalLM. Each config keeps its family's structure:
# * mistral4: q_lora, interleaved rope, YaRN (mscale changes the softmax scale) and Llama-4 position-dependent query
#   scaling (original_max_position_embeddings=8, so it changes within these 15-token sequences); dense first layer.
# * longcat_flash: every decoder layer holds two MLA sublayers (num_hidden_layers = 2 * num_layers), LoRA scaling of
#   q and the kv latent, zero (identity) experts; `head_dim` is the rope width of its rotary embedding.
# * youtu: dense MLP, q_lora, interleaved rope.
# * kimi_linear: no q_lora and no rope on the MLA layers (NoPE); layer types given explicitly, since its default
#   rule ("full_attention" at i % 4 == 0, i > 0) has no MLA layer below 5 layers.
# * axk1: DeepSeek-V3-like, q_lora, first layer dense (its default first_k_dense_replace=1).
# * bailing_hybrid: no q_lora, output gate after attention; layer_group_size=2 makes its own rule (last layer of each
#   group is MLA) give [KDA, MLA, KDA, MLA].
CONFIGS = {
    "mistral4": (
        "Mistral4ForCausalLM",
        dict(**{**COMMON, "max_position_embeddings": 32}, **_MLA, **_MOE, num_hidden_layers=2, q_lora_rank=24,
             first_k_dense_replace=1,
             rope_parameters={"type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 8, "max_position_embeddings": 32, "beta_fast": 32.0,
                              "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}),
    ),
    "longcat_flash": (
        "LongcatFlashForCausalLM",
        dict(**{k: v for k, v in COMMON.items() if k != "intermediate_size"}, **_MLA, num_layers=2, head_dim=8,
             q_lora_rank=24, ffn_hidden_size=96, expert_ffn_hidden_size=32, n_routed_experts=4, moe_topk=2,
             zero_expert_num=2),
    ),
    "youtu": (
        "YoutuForCausalLM",
        dict(**COMMON, **_MLA, num_hidden_layers=2, q_lora_rank=24),
    ),
    "kimi_linear": (
        "KimiLinearForCausalLM",
        dict(**COMMON, **_MLA, **_HYBRID_MOE, num_hidden_layers=4, q_lora_rank=None,
             layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
             linear_head_dim=16, linear_num_heads=4),
    ),
    "axk1": (
        "AXK1ForCausalLM",
        dict(**COMMON, **_MLA, **_MOE, num_hidden_layers=2, q_lora_rank=24),
    ),
    "bailing_hybrid": (
        "BailingHybridForCausalLM",
        dict(**COMMON, **_MLA, **_HYBRID_MOE, num_hidden_layers=4, q_lora_rank=None, layer_group_size=2,
             first_k_dense_replace=1, head_dim=16),
    ),
}


def make_model(model_type: str, attn: str = "flashinfer_mla", dtype=torch.float64, seed: int = 0):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no model_type {model_type!r}")
    cls_name, kwargs = CONFIGS[model_type]
    torch.manual_seed(seed)
    config = CONFIG_MAPPING[model_type](**kwargs)
    model = getattr(transformers, cls_name)._from_config(
        config, attn_implementation=attn, experts_implementation="eager", dtype=dtype
    )
    return model.eval()


def mla_layers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "kv_b_proj")]


@pytest.fixture(params=list(CONFIGS))
def other_model_type(request):
    return request.param


def test_configs_cover_the_remaining_dense_mla_types():
    covered = {"deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3"} | set(CONFIGS)  # the rest: conftest.py
    assert covered == set(hf_flashinfer_mla.DENSE_MLA_MODEL_TYPES)


def test_tiny_config_keeps_the_family_structure(other_model_type):
    model = make_model(other_model_type)
    config = model.config
    assert config.model_type == other_model_type
    n_mla = len(mla_layers(model))
    assert n_mla >= 2  # more than one MLA layer, so that per-layer cache indexing is exercised
    layer_types = getattr(config, "layer_types", None)
    if other_model_type in ("kimi_linear", "bailing_hybrid"):
        # Hybrid: both MLA (full attention) and KDA (linear attention) layers are present.
        assert n_mla == layer_types.count("full_attention") >= 1
        assert layer_types.count("linear_attention") >= 1
    else:
        assert n_mla == config.num_hidden_layers


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_batched_generate_matches_eager_alone(other_model_type, cache_implementation):
    model = make_model(other_model_type)
    ids, mask, prompts = left_padded_batch()
    # Rows pushed through kv_b_proj: the prefill expands the latent once, the decode steps must not (absorbed path),
    # so this also shows that the comparison below exercises the absorbed decode and not only the expanded prefill.
    rows = []
    hooks = [m.kv_b_proj.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[:-1].numel()))
             for m in mla_layers(model)]
    try:
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
            return_dict_in_generate=True, cache_implementation=cache_implementation,
        )
    finally:
        for h in hooks:
            h.remove()
    if cache_implementation == "dynamic":
        assert sum(rows) == ids.numel() * len(hooks)
    assert_batch_matches_eager_alone(model, out, prompts, NEW_TOKENS, TOL)


@pytest.mark.parametrize("cache_kind", ["dynamic", "static", "latent"])
def test_teacher_forced_decode_matches_eager_alone(other_model_type, cache_kind):
    model = make_model(other_model_type)
    ids, mask, prompts = left_padded_batch()
    forced = torch.randint(1, VOCAB, (len(prompts), 12), generator=torch.Generator().manual_seed(5))
    if cache_kind == "static":
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + forced.shape[1] + 4)
    elif cache_kind == "latent":
        cache = hf_flashinfer_mla.MLALatentCache(config=model.config)
    else:
        cache = DynamicCache(config=model.config)
    ours = teacher_forced_logits(model, ids, mask, forced, cache)
    model.set_attn_implementation("eager")
    for i, p in enumerate(prompts):
        ref = teacher_forced_logits(model, p[None], torch.ones(1, len(p), dtype=torch.long), forced[i : i + 1],
                                     DynamicCache(config=model.config))
        assert rel_err(ours[i], ref[0]) < TOL
