"""The family registry itself, and multimodal models whose text model is a dense MLA model.

Transformers 5.24 has one such model: Kimi-K2.5 (``kimi_k25``: a vision tower around a ``deepseek_v3`` text model,
configured as ``{"model_type": "kimi_k25", "text_config": {...}, "vision_config": {...}}``). Kimi-VL is not part of
Transformers (remote code only). The multimodal models with sparse (DSA) text models (GLM-5-next, HY-V4-VL,
Mistral-Large-4, dots3-note) are supported through their text model too (tests/test_sparse.py runs them).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import FAMILIES, HYBRIDS, decode_logits, kv_b_proj_rows, make_model, mla_layers, rel_err
from transformers import AttentionInterface

import hf_flashinfer_mla
from hf_flashinfer_mla import UnsupportedModelError

TOL = 1e-6


# Model types with a configuration of their own whose model class is another family's (tested there, and below).
SAME_CLASS_AS = {"sarvam_mla": "deepseek_v3"}


def test_registry_covers_every_dense_mla_type():
    assert set(FAMILIES) | set(SAME_CLASS_AS) == set(hf_flashinfer_mla.DENSE_MLA_MODEL_TYPES)


def test_every_model_type_transformers_builds_with_mla_attention_is_supported():
    """Every model type that Transformers' auto classes build into a model class of a modeling file with an MLA
    attention (one that defines ``expand_kv``) is supported, itself or through its text model (a multimodal
    model's ``<type>_text``; vision towers aside). Read from the installed Transformers' sources, so a new family,
    or a config of its own that reuses another family's class (``sarvam_mla``), is not missed."""
    import pathlib
    import re

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    mla_class = {}
    for path in (pathlib.Path(transformers.__file__).parent / "models").glob("*/modeling_*.py"):
        source = path.read_text()
        for name in re.findall(r"^class (\w+)\(", source, re.M):
            mla_class[name] = "def expand_kv" in source
    built = {t for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES) for t, c in mapping.items()
             if mla_class.get(c if isinstance(c, str) else c[0])}
    supported = set(hf_flashinfer_mla.DENSE_MLA_MODEL_TYPES) | set(hf_flashinfer_mla.SPARSE_MLA_MODEL_TYPES)
    missing = {t for t in built if t not in supported and f"{t}_text" not in supported and not t.endswith("_vision")}
    assert {"deepseek_v3", "deepseek_v32"} <= built and not missing, missing


@pytest.mark.parametrize("model_type", list(SAME_CLASS_AS))
def test_a_config_of_its_own_over_another_familys_class_generates_as_eager(model_type):
    """``sarvam_mla`` has its own configuration class and Transformers builds ``DeepseekV3ForCausalLM`` from it:
    it loads with flashinfer_mla, though its model type is not one of the registry's, and generates eager's tokens."""
    from helpers import left_padded_batch

    config = transformers.CONFIG_MAPPING[model_type](**FAMILIES[SAME_CLASS_AS[model_type]][1])
    ids, mask, _ = left_padded_batch()
    outs = {}
    for attn in ("flashinfer_mla", "eager"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32,
                                                              experts_implementation="eager").eval()
        outs[attn] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
    assert torch.equal(outs["flashinfer_mla"].sequences, outs["eager"].sequences)
    assert rel_err(torch.stack(outs["flashinfer_mla"].logits), torch.stack(outs["eager"].logits)) < 1e-5


def test_tiny_config_keeps_the_family_structure(model_type):
    model = make_model(model_type)
    config = model.config
    assert config.model_type == model_type
    n_mla = len(mla_layers(model))
    assert n_mla >= 2  # more than one MLA layer, so that per-layer cache indexing is exercised
    if model_type in HYBRIDS:
        # Hybrid: both MLA (full attention) and KDA (linear attention) layers are present.
        assert n_mla == config.layer_types.count("full_attention") >= 1
        assert config.layer_types.count("linear_attention") >= 1
    else:
        assert n_mla == config.num_hidden_layers


# ---------------------------------------------------------------------------------------------------- multimodal


def kimi_k25_config(**text_overrides):
    text = {"model_type": "deepseek_v3", **FAMILIES["deepseek_v3"][1], **text_overrides}
    vision = dict(num_attention_heads=2, num_hidden_layers=1, hidden_size=16, intermediate_size=32, patch_size=2,
                  pos_emb_height=4, pos_emb_width=4)
    return transformers.Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=16,
                                       image_token_id=90, video_token_id=91, vision_start_token_id=92,
                                       vision_end_token_id=93)


def kimi_k25(attn="flashinfer_mla"):
    torch.manual_seed(0)
    return transformers.AutoModelForImageTextToText.from_config(
        kimi_k25_config(), attn_implementation=attn, dtype=torch.float64, experts_implementation="eager"
    ).eval()


def implementations(model):
    return model.config._attn_implementation, model.config.text_config._attn_implementation, \
        model.config.vision_config._attn_implementation


def test_multimodal_text_model_runs_flashinfer_mla_and_matches_eager():
    model = kimi_k25()
    # The text model runs flashinfer_mla; the vision tower and the wrapper keep Transformers' default.
    assert implementations(model) == ("sdpa", "flashinfer_mla", "sdpa")
    ids = torch.randint(1, 80, (2, 10), generator=torch.Generator().manual_seed(1))  # > 8 tokens: an expanded prefill
    mask = torch.ones_like(ids)
    forced = torch.randint(1, 80, (2, 5), generator=torch.Generator().manual_seed(2))
    with kv_b_proj_rows(model) as rows:
        ours = decode_logits(model, ids, mask, forced=forced)
    assert len(mla_layers(model)) == 2 and sum(rows) == ids.numel() * 2  # decode steps absorbed: prefill rows only
    out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert all(isinstance(layer, hf_flashinfer_mla.MLALatentLayer) for layer in out.cache.layers)
    model.set_attn_implementation({"text_config": "eager"})
    assert implementations(model) == ("sdpa", "eager", "sdpa")
    assert rel_err(ours, decode_logits(model, ids, mask, forced=forced)) < TOL
    assert torch.equal(out.sequences, model.generate(input_ids=ids, max_new_tokens=4, do_sample=False))


def test_multimodal_image_forward_keeps_the_vision_tower_off_flashinfer_mla(monkeypatch):
    model = kimi_k25()
    callers = []
    ours = AttentionInterface._global_mapping["flashinfer_mla"]

    def spy(module, *args, **kwargs):
        callers.append(type(module).__name__)
        return ours(module, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "flashinfer_mla", spy)
    pixels = torch.randn(16, 3, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    inputs = dict(input_ids=torch.tensor([[5, 92, 90, 90, 90, 90, 93, 7, 8]]), pixel_values=pixels,
                  image_grid_thw=torch.tensor([[1, 4, 4]]))
    logits = model(**inputs).logits
    assert callers == ["DeepseekV3Attention"] * 2
    model.set_attn_implementation({"text_config": "eager"})
    assert rel_err(logits, model(**inputs).logits) < TOL


def test_multimodal_switching_after_load_names_the_text_model():
    model = kimi_k25(attn="sdpa")
    with pytest.raises(UnsupportedModelError,
                       match=r"multimodal.*deepseek_v3.*set_attn_implementation\(\{'text_config'"):
        model.set_attn_implementation("flashinfer_mla")
    assert implementations(model) == ("sdpa", "sdpa", "sdpa")
    model.set_attn_implementation({"text_config": "flashinfer_mla"})
    assert implementations(model) == ("sdpa", "flashinfer_mla", "sdpa")
    ids = torch.randint(1, 80, (1, 5), generator=torch.Generator().manual_seed(4))
    ours = decode_logits(model, ids, torch.ones_like(ids), steps=3)  # needs the expand_kv hook, or it raises
    model.set_attn_implementation({"text_config": "eager"})
    assert rel_err(ours, decode_logits(model, ids, torch.ones_like(ids), steps=3)) < TOL


def test_multimodal_checkpoint_loads_with_flashinfer_mla(tmp_path):
    kimi_k25(attn="eager").save_pretrained(tmp_path)  # config.json nests {"text_config": {...}, ...}
    model = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path, attn_implementation="flashinfer_mla", mla_backend="reference", dtype=torch.float64,
        experts_implementation="eager",
    )
    assert implementations(model) == ("sdpa", "flashinfer_mla", "sdpa")
    assert hf_flashinfer_mla.capabilities.requested_backend(None, model.config.text_config) == "reference"


@pytest.mark.parametrize("model_type", ["glm5_next", "hy_v4_vl", "mistral_large4", "dots3_note"])
def test_multimodal_sparse_models_resolve_to_their_sparse_text_model(model_type):
    config = transformers.AutoConfig.for_model(model_type)
    text = config.get_text_config(decoder=True)
    assert text is not config and text.model_type in hf_flashinfer_mla.SPARSE_MLA_MODEL_TYPES
    for cfg in (config, text):
        assert hf_flashinfer_mla.models.check_model_supported(cfg) is text


def test_multimodal_model_with_a_plain_dict_text_config_is_refused_with_the_reason():
    class RemoteStyleConfig(transformers.PreTrainedConfig):  # remote code that keeps its text_config as a dict
        model_type = "remote_vl"

        def __init__(self, text_config=None, **kwargs):
            self.text_config = text_config
            super().__init__(**kwargs)

    config = RemoteStyleConfig(text_config={"model_type": "deepseek_v3"})
    with pytest.raises(UnsupportedModelError, match="plain dict"):
        hf_flashinfer_mla.models.check_model_supported(config)
    config = RemoteStyleConfig(text_config={"model_type": "llama"})
    with pytest.raises(UnsupportedModelError, match=r'"remote_vl" \(text model "llama"\) is not one'):
        hf_flashinfer_mla.models.check_model_supported(config)


def test_multimodal_model_over_a_non_mla_text_model_is_refused():
    config = transformers.AutoConfig.for_model("llava")
    with pytest.raises(UnsupportedModelError, match=r'"llava" \(text model "llama"\) is not one'):
        transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="flashinfer_mla")

