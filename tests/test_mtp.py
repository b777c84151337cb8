"""MTP head == a torch reference assembled from Hugging Face blocks (HF itself has no MTP module)."""

import jax
import numpy as np
import pytest
import torch
from helpers import F, hf_text_config, random_ids, small_config, to_torch

from jaxgdn.model.cache import init_mtp_cache
from jaxgdn.model.forward import forward
from jaxgdn.model.mtp import mtp_forward
from jaxgdn.model.params import init_random_params, params_to_tensors

TOL = 1e-4


class TorchMTP(torch.nn.Module):
    """[RMS1p(E[next]) ‖ RMS1p(h)] -> Linear(2H->H) -> HF full-attention decoder layer -> RMS1p -> head."""

    def __init__(self, cfg, tensors):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import (
            Qwen3_5DecoderLayer,
            Qwen3_5RMSNorm,
            Qwen3_5TextRotaryEmbedding,
        )

        hc = hf_text_config(cfg.replace(layer_types=(F,) * cfg.num_hidden_layers))
        hc._attn_implementation = "eager"
        H = cfg.hidden_size
        self.norm_emb = Qwen3_5RMSNorm(H, cfg.rms_norm_eps)
        self.norm_hidden = Qwen3_5RMSNorm(H, cfg.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        self.layer = Qwen3_5DecoderLayer(hc, 0)
        self.norm = Qwen3_5RMSNorm(H, cfg.rms_norm_eps)
        self.rotary = Qwen3_5TextRotaryEmbedding(hc)
        t = {k: to_torch(v) for k, v in tensors.items()}
        self.norm_emb.weight.data = t["mtp.pre_fc_norm_embedding.weight"]
        self.norm_hidden.weight.data = t["mtp.pre_fc_norm_hidden.weight"]
        self.fc.weight.data = t["mtp.fc.weight"]
        self.norm.weight.data = t["mtp.norm.weight"]
        layer_state = {k[len("mtp.layers.0.") :]: v for k, v in t.items() if k.startswith("mtp.layers.0.")}
        self.layer.load_state_dict(layer_state, strict=True)
        self.embed = t["model.embed_tokens.weight"]
        self.head = t.get("lm_head.weight", self.embed)

    @torch.no_grad()
    def forward(self, hidden, next_ids):
        B, T, _ = hidden.shape
        x = torch.cat([self.norm_emb(self.embed[next_ids]), self.norm_hidden(hidden)], dim=-1)
        x = self.fc(x)
        positions = torch.arange(T)[None].expand(B, T)
        cos_sin = self.rotary(x, positions)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
        x = self.layer(x, position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
        return self.norm(x) @ self.head.T


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("T", [1, 7, 65])
def test_mtp_matches_torch_reference(tie, T):
    cfg = small_config(tie_word_embeddings=tie)
    params = init_random_params(cfg, seed=11)
    ids = random_ids(cfg, 2, T + 1, seed=T)
    _, hidden, _ = forward(params, cfg, ids[:, :T])
    ours, mtp_hidden, _ = mtp_forward(params, cfg, hidden, ids[:, 1 : T + 1])
    ref = TorchMTP(cfg, params_to_tensors(cfg, params))(to_torch(hidden), torch.as_tensor(ids[:, 1 : T + 1]))
    diff = float(np.abs(np.asarray(ours) - ref.numpy()).max())
    assert ref.abs().max() > 1.0
    assert diff <= TOL, diff
    assert mtp_hidden.shape == hidden.shape


def test_mtp_incremental_equals_full():
    """Chained use: the MTP layer's own KV cache makes step-by-step calls equal one full call."""
    cfg = small_config()
    params = init_random_params(cfg, seed=12)
    ids = random_ids(cfg, 1, 20)
    _, hidden, _ = forward(params, cfg, ids[:, :19])
    full, _, _ = mtp_forward(params, cfg, hidden, ids[:, 1:20])
    step = jax.jit(mtp_forward, static_argnums=1)
    cache = init_mtp_cache(cfg, 1, 24)
    _, _, cache = step(params, cfg, hidden[:, :12], ids[:, 1:13], cache)
    outs = []
    for t in range(12, 19):
        logits, _, cache = step(params, cfg, hidden[:, t : t + 1], ids[:, t + 1 : t + 2], cache)
        outs.append(np.asarray(logits))
    assert np.abs(np.concatenate(outs, 1) - np.asarray(full)[:, 12:]).max() <= TOL


def test_mtp_missing_head_is_a_clear_error():
    cfg = small_config()
    params = init_random_params(cfg, seed=1, include_mtp=False)
    with pytest.raises(ValueError, match="no MTP head"):
        mtp_forward(params, cfg, np.zeros((1, 1, cfg.hidden_size), np.float32), np.zeros((1, 1), np.int32))
