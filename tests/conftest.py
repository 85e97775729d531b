"""Small random MLA models built from configs (no download), and the eager oracle helpers."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.utils import logging

import hf_flashinfer_mla  # noqa: F401  (registers "flashinfer_mla")

VOCAB = 97

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    eos_token_id=None,
    pad_token_id=0,
    bos_token_id=None,
)
_COMMON = dict(**COMMON, num_hidden_layers=2)
_MOE = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
            topk_group=1)

# model_type -> (config class, kwargs). The attention dims are small but keep each family's structure: V2 without
# q_lora; V3 with q_lora, interleaved rope and YaRN scaling (which changes the softmax scale); GLM-4.7-Flash
# (glm4_moe_lite) with v_head_dim != qk_nope_head_dim; MiniCPM3 with its own latent/rope widths.
CONFIGS = {
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(**_COMMON, **_MOE, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=16),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(**_COMMON, **_MOE, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=16, rope_interleave=True,
             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    ),
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig",
        dict(**_COMMON, **{k: v for k, v in _MOE.items()}, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
             qk_nope_head_dim=24, v_head_dim=16),
    ),
    "minicpm3": (
        "MiniCPM3Config",
        dict(**_COMMON, kv_lora_rank=24, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=12, v_head_dim=12),
    ),
}


def make_config(model_type: str, **overrides):
    cls_name, kwargs = CONFIGS[model_type]
    config = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    return config


def make_model(model_type: str, attn: str = "flashinfer_mla", dtype=torch.float64, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = make_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn, experts_implementation="eager", dtype=dtype
    )
    return model.eval()


def left_padded_batch(seed: int = 1, lengths=(7, 4, 9)):
    """Token ids [B, max_len] left-padded with 0, their mask, and the unpadded prompts."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return ids, mask, prompts


def generate_alone_with_eager(model, prompts, new_tokens: int):
    """Tokens and per-step logits of each prompt generated on its own with eager attention (the oracle)."""
    model.set_attn_implementation("eager")
    try:
        runs = [
            model.generate(input_ids=p[None], max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)
            for p in prompts
        ]
    finally:
        model.set_attn_implementation("flashinfer_mla")
    return [r.sequences[0, -new_tokens:] for r in runs], [torch.cat(r.logits) for r in runs]


def assert_batch_matches_eager_alone(model, out, prompts, new_tokens: int, tol: float) -> None:
    """`out` (a batched generate() with output_logits) equals each prompt generated alone with eager."""
    tokens, logits = generate_alone_with_eager(model, prompts, new_tokens)
    for i in range(len(prompts)):
        assert torch.equal(out.sequences[i, -new_tokens:], tokens[i])
        ours = torch.stack([step[i] for step in out.logits])
        assert rel_err(ours, logits[i]) < tol


def teacher_forced_logits(model, ids, mask, forced, cache):
    """Prefill `ids`, then feed `forced` [B, T] one token per step; returns logits [B, T, V] of the decode steps."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    steps = []
    for t in range(forced.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=forced[:, t : t + 1], attention_mask=mask, position_ids=pos, cache=out.cache,
                    use_cache=True)
        steps.append(out.logits[:, -1])
    return torch.stack(steps, dim=1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(autouse=True)
def _fresh_log_once():
    """Each test sees every warn-once/info-once message afresh (they are cached per process by Transformers)."""
    logging.warning_once.cache_clear()
    logging.info_once.cache_clear()
    yield


@pytest.fixture(params=list(CONFIGS))
def model_type(request):
    return request.param
