"""ModelConfig: presets, validation messages, HF config.json in both directions."""

import json

import pytest

from zaya_jax.config import ModelConfig, from_hf_dict, preset, read_hf_config, to_hf_dict, write_hf_config
from zaya_jax.errors import ZayaError


def test_zaya1_base_is_exactly_hf_defaults():
    from transformers import ZayaConfig

    hf = ZayaConfig()
    ours = preset("zaya1_base")
    for key, value in to_hf_dict(ours).items():
        if key in ("architectures", "model_type", "dtype"):
            continue
        assert getattr(hf, key) == value, key


def test_hf_config_round_trip_through_transformers(tmp_path):
    from transformers import AutoConfig

    cfg = preset("tiny", rope_theta=1e6, cca_time1=3)
    write_hf_config(cfg, str(tmp_path))
    hf = AutoConfig.from_pretrained(str(tmp_path))
    assert hf.model_type == "zaya" and hf.rope_parameters["hybrid"]["rope_theta"] == 1e6
    assert from_hf_dict(hf.to_dict()) == cfg
    assert read_hf_config(str(tmp_path)) == cfg


def test_flat_rope_theta_is_accepted():
    hf = dict(to_hf_dict(preset("tiny")), rope_theta=1e4)
    del hf["rope_parameters"]
    assert from_hf_dict(hf).rope_theta == 1e4


@pytest.mark.parametrize("change, words", [
    (dict(num_attention_heads=6, num_key_value_heads=4), "multiple of"),
    (dict(num_experts_per_tok=2), "top-1"),
    (dict(hidden_size=0), "hidden_size must be a positive integer"),
    (dict(compute_dtype="float16"), "compute_dtype"),
    (dict(partial_rotary_factor=0.2), "even rotary width"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings"),
])
def test_invalid_configs_explain_themselves(change, words):
    with pytest.raises(ZayaError, match=words):
        preset("tiny", **change)


@pytest.mark.parametrize("change, words", [
    (dict(model_type="llama"), "not 'zaya'"),
    (dict(layer_types=["hybrid_sliding", "hybrid"], sliding_window=4097), "sliding-window"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_unsupported_hf_configs(change, words):
    with pytest.raises(ZayaError, match=words):
        from_hf_dict(dict(to_hf_dict(preset("tiny")), **change))


def test_unknown_preset():
    with pytest.raises(ZayaError, match="unknown model preset"):
        preset("zaya2")


def test_broken_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ZayaError, match="not valid JSON"):
        read_hf_config(str(tmp_path))


def test_model_parameter_count_matches_reference_accounting():
    """8.840 B total parameters for ZAYA1-base (the published 8.84B, tied embedding included), counted
    from abstract shapes."""
    import numpy as np

    from zaya_jax.model.state import expected_shapes

    shapes = expected_shapes(ModelConfig())
    total = sum(int(np.prod(s)) for k, s in shapes.items() if not k.endswith("balancing_biases"))
    assert round(total / 1e9, 3) == 8.840
    json.dumps(ModelConfig().to_dict())  # the stored form is plain JSON
