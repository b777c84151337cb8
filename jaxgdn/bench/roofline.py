"""What a step must move and compute at least: the bytes of a decode step and the matmul FLOPs of a prefill, from a
model's configuration and sizes (the bounds the benchmarks measure against)."""

from __future__ import annotations


def model_sizes(params, cfg) -> dict:
    """Bytes and matmul parameters of the trunk (MTP excluded). A tied lm_head is the embedding matrix."""
    import jax

    trunk = dict(vars(params))
    trunk.pop("mtp", None)
    leaves = jax.tree_util.tree_leaves(trunk)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
    embed = params.embed_tokens.size
    matmul_params = sum(x.size for x in leaves if x.ndim == 2) - embed  # per-token linears, no lm_head
    return {"weight_bytes": int(weight_bytes), "matmul_params": int(matmul_params), "lm_head_params": int(embed)}


def _layer_counts(cfg):
    from ..model.config import FULL_ATTENTION

    n_attn = sum(t == FULL_ATTENTION for t in cfg.layer_types)
    return n_attn, len(cfg.layer_types) - n_attn


def decode_bytes(cfg, sizes: dict, batch: int, context: int) -> int:
    """Bytes one decode step must move: every weight once, each sequence's fp32 GDN state read and
    written, its conv window, and its attention KV (bf16) read."""
    n_attn, n_gdn = _layer_counts(cfg)
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = (cfg.linear_conv_kernel_dim - 1) * (2 * cfg.linear_key_dim + cfg.linear_value_dim) * 2
    kv = context * cfg.num_key_value_heads * cfg.head_dim * 2 * 2
    return sizes["weight_bytes"] + batch * (n_gdn * 2 * (state + conv) + n_attn * kv)


def prefill_flops(cfg, sizes: dict, batch: int, length: int) -> float:
    """Matmul FLOPs of a prefill: linears per token, causal attention, the GDN chunk products, and the
    lm_head for one token per sequence."""
    n_attn, n_gdn = _layer_counts(cfg)
    tokens = batch * length
    linear = 2 * sizes["matmul_params"] * tokens
    attn = n_attn * batch * 2 * length * length * cfg.num_attention_heads * cfg.head_dim  # QKᵀ and PV, causal half
    d, C = cfg.linear_key_head_dim, 64
    gdn = n_gdn * tokens * cfg.linear_num_value_heads * (6 * d * d + 8 * C * d)
    return linear + attn + gdn + 2 * sizes["lm_head_params"] * batch
