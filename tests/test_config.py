"""config.json parsing (nested/flat, rope and layer-type variants) and the Qwen3.5-0.8B preset."""

import json
import math

import pytest
from helpers import small_config

from jaxgdn.engine.config import EngineConfig
from jaxgdn.model.config import FULL_ATTENTION, LINEAR_ATTENTION, ConfigError, ModelConfig, qwen35_0_8b
from jaxgdn.model.params import expected_tensor_shapes

TEXT = {
    "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 24,
}


def test_nested_text_config_with_rope_parameters_and_interval():
    raw = {
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": {**TEXT, "full_attention_interval": 4, "eos_token_id": 248044, "mtp_num_hidden_layers": 1,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                            "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
    }
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.layer_types == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,) + (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert cfg.tie_word_embeddings is False  # top-level flag used when text_config has none
    assert cfg.rope_theta == 1e7 and cfg.rotary_dim == 8 and cfg.mrope_section == (2, 1, 1)
    assert cfg.eos_token_ids == (248044,) and cfg.mtp_num_hidden_layers == 1


def test_flat_config_with_legacy_rope_keys_and_layer_types():
    layer_types = [FULL_ATTENTION, LINEAR_ATTENTION] * 4
    raw = {"model_type": "qwen3_5_text", **TEXT, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
           "layer_types": layer_types, "tie_word_embeddings": True, "eos_token_id": [1, 2]}
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.layer_types == tuple(layer_types) and cfg.rope_theta == 10000.0 and cfg.rotary_dim == 16
    assert cfg.eos_token_ids == (1, 2) and cfg.tie_word_embeddings


def test_text_config_tie_flag_wins_over_top_level():
    raw = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": {**TEXT, "tie_word_embeddings": True}}
    assert ModelConfig.from_hf_dict(raw).tie_word_embeddings is True


def test_to_hf_dict_round_trip():
    cfg = small_config()
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "qwen3_next"}, "unknown model_type"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
        ({"layer_types": ["mamba"] * 8}, "unknown layer type"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_bad_configs_raise_clear_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict({"model_type": "qwen3_5_text", **TEXT, **change})


def test_missing_key_is_named():
    raw = {"model_type": "qwen3_5_text", **{k: v for k, v in TEXT.items() if k != "hidden_size"}}
    with pytest.raises(ConfigError, match="'hidden_size'"):
        ModelConfig.from_hf_dict(raw, source="x/config.json")


def test_qwen35_08b_preset_matches_published_numbers():
    cfg = qwen35_0_8b()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size) == (248320, 1024, 256, 3584)
    assert cfg.attention_layer_ids == (3, 7, 11, 15, 19, 23) and len(cfg.gdn_layer_ids) == 18
    assert (cfg.linear_key_dim, cfg.linear_value_dim, cfg.conv_dim, cfg.rotary_dim) == (2048, 2048, 6144, 64)
    assert cfg.eos_token_ids == (248046, 248044) and cfg.tie_word_embeddings
    # Parameter and tensor counts derived in docs/qwen35-architecture.md §2 / §10.
    text = expected_tensor_shapes(cfg, include_mtp=False)
    full = expected_tensor_shapes(cfg, include_mtp=True)
    assert len(text) == 320 and len(full) - len(text) == 15
    assert sum(math.prod(s) for s in text.values()) == 752_393_024
    assert sum(math.prod(s) for n, s in full.items() if n.startswith("mtp.")) == 20_452_864


def test_every_engine_flag_comes_from_an_engine_config_field():
    """generate and serve: one flag per EngineConfig field, its help the field's docstring; flags parse into the
    config's values (the none words, the on/off/auto words, --no-x)."""
    import argparse
    import dataclasses

    from jaxgdn.engine_args import add_engine_args, engine_config, field_docs
    from jaxgdn.generate import parse_args
    from jaxgdn.serve.__main__ import parse_args as serve_args

    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    docs = field_docs()
    assert sorted(docs) == sorted(fields) and all(len(d) > 20 for d in docs.values())
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    text = " ".join(ap.format_help().split())
    for name in fields:
        assert "--" + name.replace("_", "-") in text and docs[name][:40] in text, name
    for parse in (parse_args, serve_args):
        args = parse(["--model", "x", "--max-num-seqs", "3", "--async-scheduling", "off", "--no-fold-norms",
                      "--library-gemms-min-tokens", "off", "-tp", "1", "--num-kv-pages", "77", "--no-precompile"])
        config = engine_config(args)
        assert (config.max_num_seqs, config.async_scheduling, config.fold_norms, config.library_gemms_min_tokens,
                config.num_kv_pages, config.precompile) == (3, False, False, None, 77, False)
    assert engine_config(serve_args(["--model", "x"])) == EngineConfig()
    with pytest.raises(SystemExit):
        serve_args(["--model", "x", "--async-scheduling", "maybe"])
