"""Checkpoint loading/saving: HF save_pretrained layouts, round trips, and clear errors for bad files."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import hf_causal_lm, hf_logits, random_ids, small_config, to_torch
from safetensors.numpy import load_file, save_file

from jaxgdn.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from jaxgdn.model.config import ConfigError
from jaxgdn.model.forward import forward
from jaxgdn.model.params import init_random_params, params_to_tensors


def assert_same_params(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def multimodal_checkpoint(tmp_path, cfg, params, max_shard_size=None):
    """Qwen3_5ForConditionalGeneration.save_pretrained with our text weights, plus synthetic mtp.* tensors.

    Everything is fp32 here so the logits can be compared tightly; the BF16-with-F32-tensors case has
    its own test. Returns the directory.
    """
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=cfg.hidden_size,
                  patch_size=4, temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
    text = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures",)}
    text["model_type"] = "qwen3_5_text"
    hc = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=cfg.tie_word_embeddings)
    model = Qwen3_5ForConditionalGeneration(hc).float()
    tensors = params_to_tensors(cfg, params)
    state = {}
    for k, v in tensors.items():
        if k.startswith("model."):
            state["model.language_model." + k[len("model."):]] = to_torch(v)
        elif k == "lm_head.weight":
            state[k] = to_torch(v)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(m.startswith("model.visual.") or m == "lm_head.weight" for m in missing)
    out = tmp_path / "mm"
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    # HF drops mtp.* (it has no MTP module): add them the way the real release ships them.
    mtp = {k: np.asarray(v, np.float32) for k, v in tensors.items() if k.startswith("mtp.")}
    save_file(mtp, str(out / "mtp.safetensors"))
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({k: "mtp.safetensors" for k in mtp})
        index.write_text(json.dumps(data))
    else:  # single file: move it into an index so both files are found
        keys = load_file(str(out / "model.safetensors")).keys()
        weight_map = {k: "model.safetensors" for k in keys} | {k: "mtp.safetensors" for k in mtp}
        index.write_text(json.dumps({"weight_map": weight_map}))
    cfg_json = json.loads((out / "config.json").read_text())
    cfg_json["text_config"]["mtp_num_hidden_layers"] = cfg.mtp_num_hidden_layers
    (out / "config.json").write_text(json.dumps(cfg_json))
    return out


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("shard", [None, "60KB"])
def test_hf_multimodal_checkpoint_loads_and_matches(tmp_path, tie, shard):
    cfg = small_config(tie_word_embeddings=tie)
    params = init_random_params(cfg, seed=4)
    path = multimodal_checkpoint(tmp_path, cfg, params, max_shard_size=shard)
    if shard:
        assert len(list(path.glob("model-*.safetensors"))) > 1
    keys = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith("model.visual.") for k in keys) and any(k.startswith("mtp.") for k in keys)
    assert "model.language_model.layers.0.linear_attn.A_log" in keys
    loaded_cfg, loaded = load_checkpoint(path, dtype=jnp.float32)
    assert loaded_cfg.tie_word_embeddings == tie and loaded.mtp is not None
    assert_same_params(params, loaded)
    ids = random_ids(cfg, 2, 9)
    ours = np.asarray(forward(loaded, loaded_cfg, ids)[0])
    ref = hf_logits(hf_causal_lm(cfg, params), ids)
    assert np.abs(ours - ref).max() <= 1e-4


def test_text_only_save_pretrained_loads(tmp_path):
    """Qwen3_5ForCausalLM.save_pretrained (prefix `model.`, no mtp): loads without an MTP head."""
    cfg = small_config()
    params = init_random_params(cfg, seed=5)
    hf = hf_causal_lm(cfg, params)
    hf.save_pretrained(tmp_path / "text")
    with pytest.warns(UserWarning, match="no mtp"):
        loaded_cfg, loaded = load_checkpoint(tmp_path / "text", dtype=jnp.float32)
    assert loaded.mtp is None
    ids = random_ids(cfg, 1, 5)
    assert np.abs(np.asarray(forward(loaded, loaded_cfg, ids)[0]) - hf_logits(hf, ids)).max() <= 1e-4


def test_bf16_checkpoint_keeps_fp32_tensors(tmp_path):
    """Real checkpoints: BF16 everywhere except F32 A_log and gated-norm weight; dtype policy on load."""
    cfg = small_config()
    path = save_checkpoint(tmp_path / "ck", cfg, init_random_params(cfg, 6, jnp.bfloat16))
    stored = load_file(str(path / "model.safetensors"))
    assert stored["model.layers.0.linear_attn.A_log"].dtype == np.float32
    assert stored["model.layers.0.linear_attn.norm.weight"].dtype == np.float32
    assert str(stored["model.layers.0.linear_attn.dt_bias"].dtype) == "bfloat16"
    _, p16 = load_checkpoint(path, dtype=jnp.bfloat16)
    assert p16.layers[0].mixer.A_log.dtype == jnp.float32 and p16.layers[0].mixer.in_proj_qkv.dtype == jnp.bfloat16
    _, p32 = load_checkpoint(path, dtype=jnp.float32)
    assert p32.layers[0].mixer.in_proj_qkv.dtype == jnp.float32


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("max_shard_bytes", [None, 50_000])
def test_our_save_then_load_is_identical(tmp_path, tie, max_shard_bytes):
    cfg = small_config(tie_word_embeddings=tie)
    params = init_random_params(cfg, seed=7)
    save_checkpoint(tmp_path / "ours", cfg, params, max_shard_bytes=max_shard_bytes)
    loaded_cfg, loaded = load_checkpoint(tmp_path / "ours", dtype=jnp.float32)
    assert loaded_cfg == cfg.replace(model_type="qwen3_5_text")
    assert_same_params(params, loaded)
    # and transformers reads our layout too
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32, attn_implementation="eager")
    ids = random_ids(cfg, 1, 6)
    assert np.abs(np.asarray(forward(loaded, loaded_cfg, ids)[0]) - hf_logits(hf.eval(), ids)).max() <= 1e-4


# ------------------------------------------------------------------------------------------ bad input
@pytest.fixture
def good_checkpoint(tmp_path):
    cfg = small_config()
    return save_checkpoint(tmp_path / "good", cfg, init_random_params(cfg, seed=8)), cfg


def test_missing_tensors_are_listed(good_checkpoint):
    path, _ = good_checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    gone = ["model.layers.1.linear_attn.A_log", "model.norm.weight"]
    save_file({k: v for k, v in tensors.items() if k not in gone}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="2 tensor\\(s\\) missing") as e:
        load_checkpoint(path)
    assert all(name in str(e.value) for name in gone)


def test_shape_mismatch_names_file_tensor_and_shapes(good_checkpoint):
    path, cfg = good_checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.3.self_attn.q_proj.weight"] = np.zeros((7, cfg.hidden_size), np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert "model.safetensors" in msg and "q_proj" in msg and "[7, 64]" in msg and "[256, 64]" in msg


def test_unknown_model_type(good_checkpoint):
    path, _ = good_checkpoint
    raw = json.loads((path / "config.json").read_text())
    raw["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        load_checkpoint(path)


def test_unreadable_json(good_checkpoint):
    path, _ = good_checkpoint
    (path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: unreadable JSON"):
        load_checkpoint(path)


def test_missing_files(tmp_path, good_checkpoint):
    path, _ = good_checkpoint
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_checkpoint(tmp_path / "nowhere")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(path)


def test_index_pointing_at_missing_shard(tmp_path):
    cfg = small_config()
    path = save_checkpoint(tmp_path / "sh", cfg, init_random_params(cfg, seed=9), max_shard_bytes=50_000)
    victim = sorted(path.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_checkpoint(path)


def test_corrupt_safetensors(good_checkpoint):
    path, _ = good_checkpoint
    (path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(path)
    shutil.rmtree(path)
