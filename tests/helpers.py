"""The suite's library: small random MLA models of every supported family (no download), the decode loop, the
generation modes, and the eager oracles. Test files import it as ``from helpers import ...`` (pytest puts tests/ on
the path, as it does for conftest.py); conftest.py keeps only fixtures."""

from __future__ import annotations

import contextlib
import inspect
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import hf_flashinfer_mla  # noqa: F401  (registers "flashinfer_mla")
from hf_flashinfer_mla.kernels import Layer
from hf_flashinfer_mla.plan import StepPlan
from hf_flashinfer_mla.rows import GrowingMask, Rows

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
_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
_MOE = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
            topk_group=1)
# Kimi-Linear and Bailing-hybrid name their MoE fields differently (num_experts, num_experts_per_token, ...).
_HYBRID_MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_token=2, num_shared_experts=1, n_group=1,
                   topk_group=1)

# The one registry of the dense MLA families: model_type -> (causal-LM class, config kwargs). The class is named
# because Transformers 5.24 does not map mistral4 in AutoModelForCausalLM. The attention dims are small but each
# config keeps its family's structure:
# * deepseek_v2: no q_lora, MoE after a dense first layer.
# * deepseek_v3: q_lora, interleaved rope and YaRN scaling (which changes the softmax scale).
# * glm4_moe_lite (GLM-4.7-Flash): v_head_dim != qk_nope_head_dim.
# * minicpm3: its own latent/rope widths (24 + 4; the real model has 256 + 32, not the kernels' 512 + 64).
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
FAMILIES = {
    "deepseek_v2": (
        "DeepseekV2ForCausalLM",
        dict(**_COMMON, **_MOE, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=16),
    ),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        dict(**_COMMON, **_MOE, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=16, rope_interleave=True,
             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    ),
    "glm4_moe_lite": (
        "Glm4MoeLiteForCausalLM",
        dict(**_COMMON, **_MOE, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=24,
             v_head_dim=16),
    ),
    "minicpm3": (
        "MiniCPM3ForCausalLM",
        dict(**_COMMON, kv_lora_rank=24, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=12, v_head_dim=12),
    ),
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
HYBRIDS = ("kimi_linear", "bailing_hybrid")  # MLA layers interleaved with KDA linear-attention layers

# Sparse-MLA (DSA) families: the same structure as FAMILIES (model_type -> (class, config kwargs)); reuses COMMON, _MLA
# and _MOE. index_n_heads=8 (not 2): with 2 ReLU'd indexer heads many keys score exactly 0 and torch.topk breaks the
# tie differently for a [S, T] prefill row, a [1, T] decode row and a static cache's longer row, so a cached decode
# (or a static cache) disagrees with a full forward in Transformers' own eager; with 8 heads no boundary ties occur on
# these prompts. index_topk=4 < the 7-15 token prompts, so selection changes the logits (by 0.16-0.31).
# * deepseek_v32: every layer selects; YaRN with mscale_all_dim (changes the softmax scale); first MLP dense.
# * glm_moe_dsa: layer 2 reuses layer 1's top-k (indexer_types; = index_topk_freq=2, index_skip_topk_offset=2).
# * glm5_next (multimodal only, no causal LM): NoPE MLA (qk_rope_head_dim must be 0) in a KDA hybrid; layer 2 reuses
#   layer 1's top-k (the sharing layer must directly follow the full one); k-pool indexer
#   (index_topk % index_kpool == 0).
# * mistral_large4 (multimodal only): no q_lora; layer 3 NoPE; layer 2 reuses layer 1's latent KV (kv_source_layers)
#   and its top-k; learned LeRoPE alpha and per-head log-position query scaling (identity at init).
# * hy_v4 / hy_v4_vl: sinks (s_aux), output gate, iHC streams; default indexer_types [F, F, S, S]; sdpa unsupported;
#   initializer_range=0.02 (the default 0.006 leaves the selection almost without effect); hy_v4_vl: M-RoPE sections.
# * axk2: fused q/gate projection from the q latent (no q_b_proj), output gate, gated RMSNorms.
# * dots3_note_text: layers 0-1 DSA, 2-3 sliding-window MLA (no indexer) with their own widths (swa_*).
_DSA = dict(index_topk=4, index_n_heads=8, index_head_dim=16)
DSA_FAMILIES = {
    "deepseek_v32": (
        "DeepseekV32ForCausalLM",
        dict(**COMMON, **_MLA, **_MOE, **_DSA, num_hidden_layers=2, q_lora_rank=24, first_k_dense_replace=1,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                              "mscale": 1.0, "mscale_all_dim": 1.0}),
    ),
    "glm_moe_dsa": (
        "GlmMoeDsaForCausalLM",
        dict(**COMMON, **_MLA, **_MOE, **_DSA, num_hidden_layers=4, q_lora_rank=24, first_k_dense_replace=1,
             indexer_types=["full", "full", "shared", "full"]),
    ),
    "glm5_next": (
        "Glm5NextForConditionalGeneration",
        dict(
            text_config=dict(
                **COMMON, **_MOE, **_DSA, num_hidden_layers=4, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=0,
                qk_nope_head_dim=16, v_head_dim=16, index_kpool=2,
                layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
                indexer_types=["full", "full", "shared", "full"],
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                linear_head_dim=16, linear_num_heads=4, hc_mult=2,
            ),
            vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
                               projection_intermediate_size=32),
        ),
    ),
    "mistral_large4": (
        "MistralLarge4ForConditionalGeneration",
        dict(
            text_config=dict(
                **COMMON, **_MLA, **_MOE, **_DSA, num_hidden_layers=4, first_k_dense_replace=1,
                indexer_types=["full", "full", "shared", "full"], no_rope_layers=[1, 1, 1, 0],
                kv_source_layers=[0, 1, 1, 3],
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "attention_factor": 1.0},
            ),
            vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, patch_size=14, image_size=56, hidden_act="silu"),
        ),
    ),
    "hy_v4": (
        "HYV4ForCausalLM",
        dict(**COMMON, **_MLA, **_MOE, **_DSA, num_hidden_layers=4, q_lora_rank=24, learnable_sink_init=0.5,
             initializer_range=0.02),
    ),
    "hy_v4_vl": (
        "HYV4VLForConditionalGeneration",
        dict(
            text_config=dict(
                **COMMON, **_MLA, **_MOE, **_DSA, num_hidden_layers=4, q_lora_rank=24, learnable_sink_init=0.5,
                initializer_range=0.02,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
            ),
            vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                               out_hidden_size=64, patch_size=16, max_image_size=64),
        ),
    ),
    "axk2": (
        "AXK2ForCausalLM",
        dict(**COMMON, **_MLA, **_MOE, **_DSA, num_hidden_layers=2, q_lora_rank=24, gated_norm_rank=8),
    ),
    "dots3_note_text": (
        "Dots3NoteForCausalLM",
        dict(**COMMON, **_MLA, **_MOE, **_DSA, num_hidden_layers=4, q_lora_rank=24, head_dim=24,
             shared_experts_intermediate_size=32, sliding_window=4, swa_num_attention_heads=2,
             swa_num_key_value_heads=2, swa_q_lora_rank=24, swa_kv_lora_rank=48, swa_head_dim=32,
             swa_qk_nope_head_dim=24, swa_v_head_dim=16),
    ),
}


def make_config(model_type: str, **overrides):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no model_type {model_type!r}")
    return CONFIG_MAPPING[model_type](**{**_registry(model_type)[1], **overrides})


def _registry(model_type: str):
    return FAMILIES[model_type] if model_type in FAMILIES else DSA_FAMILIES[model_type]


def make_model(model_type: str, attn: str = "flashinfer_mla", dtype=torch.float64, seed: int = 0, **overrides):
    config = make_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, _registry(model_type)[0])._from_config(
        config, attn_implementation=attn, experts_implementation="eager", dtype=dtype
    )
    if model_type in DSA_FAMILIES:
        _perturb_identity_parameters(model, seed)
    return model.eval()


# Parameters some DSA families initialise to an identity (learned query scaling, LeRoPE's frequency scale, GLM-5's
# pool compression) or to one value for every head (sinks): shifted, so that the tests exercise them.
_IDENTITY_AT_INIT = ("softmax_scaling.", "rotary_emb.alpha", "index_kpool_compress", "sinks")


def _perturb_identity_parameters(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(key in name for key in _IDENTITY_AT_INIT):
                p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def count_calls(monkeypatch, owner, name: str) -> list:
    """``owner.name`` replaced by a spy that runs it and counts its calls: the list gets one entry per call."""
    calls, real = [], getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def set_attention(model, name: str) -> None:
    """Switch `model`'s attention to `name`; for a multimodal model, its text model's (custom implementations
    are set per sub-model, and a test compares the language model's attention only)."""
    composite = model.config.get_text_config(decoder=True) is not model.config
    model.set_attn_implementation({"text_config": name} if composite and name != "eager" else name)


def mla_layers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "kv_b_proj")]


# The latent width of a model whose kv_b_proj bitsandbytes quantizes: its CPU kernels (on CPUs with AVX512-BF16)
# pack 4-bit weights in blocks of 64 inputs and fail for narrower ones (`shape '[128, 0]' is invalid`).
BNB_RANK = 64


def kv_b_proj_to_4bit(model) -> None:
    """Every MLA layer's kv_b_proj replaced by a bitsandbytes 4-bit (nf4) copy of it; the test is skipped where
    bitsandbytes is missing or cannot quantize on this CPU. The model's latent must be `BNB_RANK` wide (or a
    multiple of it): ``make_model(..., kv_lora_rank=BNB_RANK)``."""
    bnb = pytest.importorskip("bitsandbytes")
    for m in mla_layers(model):
        lin = m.kv_b_proj
        assert lin.in_features % BNB_RANK == 0, f"give the model kv_lora_rank={BNB_RANK} (bitsandbytes' CPU blocks)"
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.float32,
                              quant_type="nf4")
        q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4")
        # (On a CPU with AVX512-BF16 bitsandbytes would repack the weight at the first forward for a kernel that
        # computes in bf16: eager's numbers would then depend on the CPU. Off, every CPU computes in float32;
        # test_absorption checks a repacked weight on its own.)
        q.support_avx512bf16_for_cpu = False
        try:
            m.kv_b_proj = q.to("cpu")
        except Exception as exc:  # bitsandbytes without a CPU backend
            pytest.skip(f"bitsandbytes cannot quantize on this CPU: {exc}")


@contextlib.contextmanager
def kv_b_proj_rows(model):
    """Rows each MLA layer's kv_b_proj receives while the block runs (one entry per call with a sequence-shaped
    input ``[B, 1, S, rank]``: an expansion of cached latents; a derivation of its matrix does not count). Recorded
    by wrapping the forward of kv_b_proj's class, not with a hook or on the instance: the package decodes through a
    kv_b_proj with hooks or a replaced forward (it cannot see what they do), which would change what is measured."""
    rows, projs = [], {id(m.kv_b_proj) for m in mla_layers(model)}
    with pytest.MonkeyPatch.context() as mp:
        for cls in {type(m.kv_b_proj) for m in mla_layers(model)}:
            def forward(self, x, *args, _inner=cls.forward, **kwargs):
                if id(self) in projs and x.dim() >= 3:
                    rows.append(x.shape[:-1].numel())
                return _inner(self, x, *args, **kwargs)
            mp.setattr(cls, "forward", forward)
        yield rows


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


def decode_logits(model, ids, mask, cache=None, forced=None, steps=None, chunks=None, as_generate=False,
                  forward=None, **kwargs) -> torch.Tensor:
    """Prefill `ids` (padded as `mask` says, on either side), then decode; returns the decode logits ``[B, T, V]``.

    The one decode loop of the suite. Decoding feeds `forced` ``[B, T]`` (teacher forcing), ``chunks[i]`` tokens per
    forward (one by default), or, without `forced`, the argmax token `steps` times. Positions count the attended
    tokens, so a right-padded prompt continues after its last real token. `cache` defaults to the one the model's
    forward builds when it is called without one (a fresh `DynamicCache`); `kwargs` go to every forward (e.g.
    ``mla_backend=``). ``as_generate=True`` grows the 2D mask through ``generate()``'s own mask update
    (``_update_model_kwargs_for_generation``), so the steps see what ``generate()``'s steps see (rows known on the
    host, the next step planned ahead); `forward` (default: the model) runs the decode steps, e.g. a compiled model.
    """
    forward = model if forward is None else forward
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache,
                use_cache=True, **kwargs)
    cache = out.cache
    sizes = list(chunks) if chunks else [1] * (forced.shape[1] if forced is not None else steps)
    logits, done = [], 0
    for n in sizes:
        tokens = forced[:, done : done + n] if forced is not None else out.logits[:, -1:].argmax(-1)
        pos = mask.sum(-1, keepdim=True) + torch.arange(n, device=mask.device)
        if as_generate:
            mask = model._update_model_kwargs_for_generation(out, {"attention_mask": mask}, num_new_tokens=n)[
                "attention_mask"]
        else:
            mask = torch.cat([mask, torch.ones_like(tokens)], dim=-1)
        out = forward(input_ids=tokens, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, **kwargs)
        logits.append(out.logits)
        done += n
    return torch.cat(logits, dim=1)


def assisted_generate(main, helper, prompt, new_tokens: int = 12):
    """``main.generate(assistant_model=helper)`` over one unpadded prompt (Transformers' assisted generation takes
    batch 1), drafting a fixed 4 tokens whatever the assistant's confidence (set on the assistant's own generation
    config, where Transformers reads it): the main model verifies them in one forward of 5 tokens."""
    helper.generation_config.num_assistant_tokens = 4
    helper.generation_config.num_assistant_tokens_schedule = "constant"
    helper.generation_config.assistant_confidence_threshold = 0.0
    return main.generate(input_ids=prompt[None], max_new_tokens=new_tokens, do_sample=False, assistant_model=helper,
                         output_logits=True, output_scores=True, return_dict_in_generate=True)


# What `chained_generate` appends before each continuation: three tokens per row; tokens of different lengths per
# row, padded where they join the history (holes in the 2D mask); one token.
CHAINED_APPENDS = [
    (torch.tensor([[11, 12, 13], [14, 15, 16], [17, 18, 19]]), torch.ones(3, 3, dtype=torch.long)),
    (torch.tensor([[0, 0, 5], [0, 7, 8], [9, 10, 11]]), torch.tensor([[0, 0, 1], [0, 1, 1], [1, 1, 1]])),
    (torch.tensor([[3], [4], [5]]), torch.ones(3, 1, dtype=torch.long)),
]


def chained_generate(model, ids, mask, new_tokens: int = 4) -> list:
    """generate() over a batch of 3, then once more per `CHAINED_APPENDS` entry, each call continuing the previous
    call's cache with its sequences and the appended tokens; every call's output (logits included)."""
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    calls, mask = [out], torch.cat([mask, torch.ones(3, new_tokens, dtype=torch.long)], -1)
    for tokens, tokens_mask in CHAINED_APPENDS:
        mask = torch.cat([mask, tokens_mask], -1)
        out = model.generate(input_ids=torch.cat([out.sequences, tokens], -1), attention_mask=mask, cache=out.cache,
                             max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        calls.append(out)
        mask = torch.cat([mask, torch.ones(3, new_tokens, dtype=torch.long)], -1)
    return calls


def eos_generate(model, ids, mask, eos: int, cache_implementation: str = "dynamic", new_tokens: int = 10):
    """Greedy generate() that stops each row at `eos` (padding it with 0 while the others go on), logits included."""
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          eos_token_id=eos, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                          cache_implementation=cache_implementation, disable_compile=True)


def early_eos(model, ids, mask) -> int:
    """The token row 1 of ``left_padded_batch(lengths=(7, 4, 9))`` generates third (greedy): as `eos_generate`'s
    eos, that row stops early and row 0 runs to the end (for the test models' seeds)."""
    return int(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)[1, -1])


class SecondModelStepper(LogitsProcessor):
    """Steps another model over its own left-padded batch, one forward per call: the prefill at the first call,
    then one greedy token per call (or ``forced[:, t]``, to follow another run's `fed` tokens), with its own
    DynamicCache and its own growing 2D mask. Records that model's last-token logits and the tokens it fed, and
    returns the scores unchanged (so it must not change the main generation at all)."""

    def __init__(self, model, ids, mask, four_d: bool = False, forced: torch.Tensor | None = None):
        self.model, self.ids, self.mask, self.four_d, self.forced = model, ids, mask, four_d, forced
        self.cache = DynamicCache(config=model.config)
        self.logits: list[torch.Tensor] = []
        self.fed: list[torch.Tensor] = []

    def step(self) -> None:
        mask = None
        if not self.logits:
            ids, pos = self.ids, (self.mask.cumsum(-1) - 1).clamp(min=0)
        else:
            t = len(self.fed)
            ids = self.forced[:, t : t + 1] if self.forced is not None else self.logits[-1].argmax(-1, keepdim=True)
            self.fed.append(ids)
            pos = self.mask.sum(-1, keepdim=True)
            self.mask = torch.cat([self.mask, torch.ones_like(ids)], dim=-1)
            # (`four_d`: decode steps get a 4D float mask of the user's own, as eager's masks are)
            mask = additive_mask(self.mask, 1, "plain", torch.float32) if self.four_d else None
        out = self.model(input_ids=ids, attention_mask=self.mask if mask is None else mask, position_ids=pos,
                         cache=self.cache, use_cache=True)
        self.logits.append(out.logits[:, -1])

    def __call__(self, input_ids, scores):
        self.step()
        return scores

    def recorded(self) -> torch.Tensor:
        return torch.stack(self.logits, dim=1)  # [B, steps, V]


# Generation modes whose steps get their rows from every source the package has (`generation_mode`): assisted
# steps come without a 2D mask; eos, beams, sampling and the main steps of guidance and of a second model's
# generate() from generate()'s grown masks; the chained calls' holes, guidance's own forward and the second model's
# loop (`SecondModelStepper`, a logits processor) from their masks.
GENERATION_MODES = ("assisted-other", "assisted-self", "eos-dynamic", "eos-static", "chained-holes", "beams",
                    "sampling", "guidance", "second-model")
_BATCH_MODES = {
    "beams": dict(num_beams=3, num_return_sequences=2, do_sample=False),  # the cache reordered every step
    "sampling": dict(do_sample=True, top_k=20, num_return_sequences=2),  # the batch repeated per sequence
    "guidance": dict(do_sample=False, guidance_scale=1.5),  # a second forward per step, over a negative prompt
}


def generation_mode(mode: str, lengths=(7, 4, 9)) -> list:
    """One process's generate() calls in `mode` (`GENERATION_MODES`), on fresh float64 models (the kernel
    stand-ins' dtype) and a left-padded batch of prompts of `lengths`: their outputs, logits included. The eos and
    chained modes need the default lengths (a batch of 3, whose row 1 stops early at `early_eos`)."""
    model = make_model("deepseek_v3")
    ids, mask, prompts = left_padded_batch(lengths=lengths)
    if mode.startswith("assisted"):
        helper = model if mode == "assisted-self" else make_model("deepseek_v2", seed=1)
        return [assisted_generate(model, helper, p) for p in prompts]
    if mode == "chained-holes":
        return chained_generate(model, ids, mask)
    if mode.startswith("eos-"):
        return [eos_generate(model, ids, mask, early_eos(model, ids, mask), mode.removeprefix("eos-"))]
    if mode == "second-model":  # another model stepped over its own padded batch by a logits processor
        ids2, mask2, _ = left_padded_batch(seed=4, lengths=(5, 8, 2))
        stepper = SecondModelStepper(make_model("deepseek_v2", seed=1), ids2, mask2)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, logits_processor=LogitsProcessorList([stepper]))
        stepped = SimpleNamespace(sequences=stepper.recorded().argmax(-1), logits=stepper.logits)
        return [out, stepped]
    extra = {}
    if mode == "guidance":
        extra["negative_prompt_ids"] = torch.randint(1, VOCAB, (len(lengths), 8),
                                                     generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)  # (sampling draws the same tokens in every run)
    return [model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, output_logits=True,
                           return_dict_in_generate=True, **_BATCH_MODES[mode], **extra)]


def assert_same_outputs(ours: list, ref: list, tol: float) -> None:
    """Two runs of `generation_mode` agree: every call's tokens exactly, its logits to `tol`."""
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert torch.equal(a.sequences, b.sequences), i
        assert rel_err(torch.stack(a.logits), torch.stack(b.logits)) < tol, i


def additive_mask(attention_mask: torch.Tensor, q_len: int, kind: str = "alibi", dtype=torch.float64) -> torch.Tensor:
    """A 4D float mask ``[B, 1, q_len, S]`` for a step of the last `q_len` tokens of the 2D `attention_mask`
    ``[B, S]``, hiding the future and its zeros: "alibi" adds -0.5 per position of distance to what it shows and
    hides with the dtype's minimum; "finite" shows with 0 and hides with -1e4, as BERT-style code does; "plain"
    shows with 0 and hides with the minimum, as eager's own masks do. Feed it to `decode_logits` through
    ``forward=with_4d_masks(model, kind)``."""
    kv_len = attention_mask.shape[-1]
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    shown = (torch.arange(kv_len) <= q_pos) & attention_mask.bool()[:, None, None, :]
    if kind == "finite":
        return torch.zeros(shown.shape, dtype=dtype).masked_fill(~shown, -1e4)
    distance = (q_pos - torch.arange(kv_len)).to(dtype) * (kind == "alibi")
    return (-0.5 * distance).expand(shown.shape).masked_fill(~shown, torch.finfo(dtype).min)


def with_4d_masks(model, kind: str = "alibi", reshape=None, dtype=torch.float64):
    """A decode step's forward that hands `model` the step's `additive_mask` instead of its 2D mask (passed through
    `reshape` first, if given)."""
    def forward(input_ids, attention_mask, **kwargs):
        mask = additive_mask(attention_mask, input_ids.shape[1], kind, dtype)
        return model(input_ids=input_ids, attention_mask=mask if reshape is None else reshape(mask), **kwargs)
    return forward


def eager_alone(model, prompts, forced, chunks=None) -> list[torch.Tensor]:
    """The oracle for `decode_logits`: each prompt decoded on its own, unpadded, with eager attention."""
    set_attention(model, "eager")
    try:
        return [
            decode_logits(model, p[None], torch.ones(1, len(p), dtype=torch.long), forced=forced[i : i + 1],
                          chunks=chunks)[0]
            for i, p in enumerate(prompts)
        ]
    finally:
        set_attention(model, "flashinfer_mla")


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


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def package_warnings(caplog) -> list[str]:
    """Messages of the warnings this package logged."""
    return [r.getMessage() for r in caplog.records if r.name == "hf_flashinfer_mla" and r.levelno >= 30]


# Step planning (rows, masks, plans, fa3 metadata, graph slots).
def spy(monkeypatch, owner, name):
    """Record the calls of ``owner.name`` (a function, or a classmethod of a class) and pass them on."""
    calls = []
    is_classmethod = isinstance(inspect.getattr_static(owner, name), classmethod)
    original = getattr(owner, name)

    def recorded(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, staticmethod(recorded) if is_classmethod else recorded)
    return calls


def fa_layer(device=torch.device("cpu"), heads=4, pitch=64, scale=0.1) -> Layer:
    """The spec of one fa3 call over the latent of `FAMILIES`' deepseek_v3 (32 + 8), in float64."""
    return Layer(device, torch.float64, torch.float64, heads, 32, 8, pitch, False, scale)


def rows_on_host(first, width, q_len=1) -> Rows:
    """Rows known on the host, as generate()'s `GrowingMask` gives them: row b sees ``[first[b], width)``."""
    first = torch.as_tensor(first, dtype=torch.long)
    return GrowingMask(first, first, width).rows(q_len, width)


def route_of(step: StepPlan, layer: Layer, requested="fa3"):
    """The step's route for `layer`, as the attention function asks for it (built, not run)."""
    return step.route((layer, requested), layer, requested, False)


def bool_mask(rows):
    """A boolean 2D mask from nested lists of 0/1."""
    return torch.tensor(rows, dtype=torch.bool)


# ------------------------------------------------------------------------------- asynchronous batching on a CPU
class FakeStream:
    """A device stream on a host that runs everything in order."""

    def record_event(self, event=None):
        return event

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class FakeEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        pass


class _TorchWithEvents:
    """torch as Transformers' IO module sees it, with events a CPU can record."""

    Event = FakeEvent

    def __getattr__(self, name):
        return getattr(torch, name)


def emulate_async_batching(monkeypatch) -> None:
    """Transformers' asynchronous batching on this host, which it refuses without an accelerator: its two IO pairs
    accept the CPU, their streams and events do nothing (the work runs in order), so what runs is the host's side
    of it: step N+1 prepared before step N's tokens are read, tokens carried over on the "device"."""
    from transformers.generation.continuous_batching import input_outputs

    monkeypatch.setattr(input_outputs.ContinuousBatchingAsyncIOs, "_supported_device_types", ("cuda", "xpu", "cpu"))
    monkeypatch.setattr(input_outputs, "create_device_stream", lambda device: FakeStream())
    monkeypatch.setattr(input_outputs, "torch", _TorchWithEvents())
