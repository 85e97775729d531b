"""The family registry itself (``conftest.FAMILIES``); the families are compared against eager in ``test_models.py``."""

from __future__ import annotations

from conftest import FAMILIES, HYBRIDS, make_model, mla_layers

import hf_flashinfer_mla


def test_registry_covers_every_dense_mla_type():
    assert set(FAMILIES) == set(hf_flashinfer_mla.DENSE_MLA_MODEL_TYPES)


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
