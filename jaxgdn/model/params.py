"""Parameter pytrees and their one-to-one map onto Hugging Face tensor names.

Every weight keeps its Hugging Face shape ([out, in] for linears, [C, 1, Kc] for the conv), so the map
to and from a checkpoint is a pure renaming. `expected_tensor_shapes` is the single source of truth for
which tensors a config needs; loading, saving, validation and random init all read it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .config import FULL_ATTENTION, ModelConfig

Array = Any

# Tensors kept in fp32 whatever the weight dtype: they feed fp32 math and are F32 on disk (docs/qwen35-architecture.md §2).
FP32_TENSOR_SUFFIXES = ("linear_attn.A_log", "linear_attn.norm.weight")
RESIDUAL_OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


@struct.dataclass
class AttentionParams:
    q_proj: Array  # [2*Hq*D, H]: per head [query_h ‖ gate_h]
    k_proj: Array  # [Hkv*D, H]
    v_proj: Array  # [Hkv*D, H]
    o_proj: Array  # [H, Hq*D]
    q_norm: Array  # [D] (1+w)
    k_norm: Array  # [D] (1+w)
    fused: Array | None = None  # serving: [q_proj ‖ k_proj ‖ v_proj] (see fuse_projections)


@struct.dataclass
class GDNParams:
    in_proj_qkv: Array  # [2*Kd + Vd, H]
    in_proj_z: Array  # [Vd, H]
    in_proj_b: Array  # [Hv, H]
    in_proj_a: Array  # [Hv, H]
    conv1d: Array  # [C, 1, Kc], tap Kc-1 multiplies the current token
    dt_bias: Array  # [Hv]
    A_log: Array  # [Hv] fp32
    norm: Array  # [dv] fp32, plain w
    out_proj: Array  # [H, Vd]
    fused: Array | None = None  # serving: [in_proj_qkv ‖ in_proj_z ‖ in_proj_b ‖ in_proj_a]


@struct.dataclass
class MLPParams:
    gate_proj: Array  # [I, H]
    up_proj: Array  # [I, H]
    down_proj: Array  # [H, I]
    fused: Array | None = None  # serving: [gate_proj ‖ up_proj]


@struct.dataclass
class DecoderLayerParams:
    input_layernorm: Array | None  # [H] (1+w); None when folded into the projections (fold_norms)
    post_attention_layernorm: Array | None  # [H] (1+w); None when folded into the MLP's (fold_norms)
    mixer: Any  # AttentionParams or GDNParams
    mlp: MLPParams


@struct.dataclass
class MTPParams:
    pre_fc_norm_embedding: Array  # [H] (1+w)
    pre_fc_norm_hidden: Array  # [H] (1+w)
    fc: Array  # [H, 2H], input [emb ‖ hidden]
    layers: tuple  # of DecoderLayerParams (full attention)
    norm: Array  # [H] (1+w)


@struct.dataclass
class ModelParams:
    embed_tokens: Array  # [V, H]
    layers: tuple  # of DecoderLayerParams, one per config layer
    norm: Array  # [H] (1+w)
    lm_head: Array | None  # [V, H], None when tied to embed_tokens
    mtp: MTPParams | None  # None when the checkpoint has no MTP head

    def head_weight(self) -> Array:
        return self.embed_tokens if self.lm_head is None else self.lm_head


# ------------------------------------------------------------------------------------- serving layout
# The projections of a layer that read the same input, in the order fuse_projections concatenates them.
FUSED_PROJECTIONS = {
    AttentionParams: ("q_proj", "k_proj", "v_proj"),
    GDNParams: ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    MLPParams: ("gate_proj", "up_proj"),
}


def fuse_projections(params: ModelParams) -> ModelParams:
    """The serving layout: in every layer (trunk and MTP), the projections that read the same input
    concatenated along their output axis into `fused` (the separate weights set to None), so a step runs
    one matrix product where it ran two to four: fewer kernels, which a decode step on the GPU is bound by.
    Same values; `project` reads either layout. Idempotent."""

    def fuse(p):
        names = FUSED_PROJECTIONS.get(type(p))
        if names is None or p.fused is not None:
            return p
        fused = jnp.concatenate([getattr(p, n) for n in names], axis=0)
        return dataclasses.replace(p, fused=fused, **{n: None for n in names})

    def fuse_layer(layer: DecoderLayerParams) -> DecoderLayerParams:
        return dataclasses.replace(layer, mixer=fuse(layer.mixer), mlp=fuse(layer.mlp))

    mtp = params.mtp
    if mtp is not None:
        mtp = dataclasses.replace(mtp, layers=tuple(map(fuse_layer, mtp.layers)))
    return dataclasses.replace(params, layers=tuple(map(fuse_layer, params.layers)), mtp=mtp)


def fold_norms(params: ModelParams) -> ModelParams:
    """The serving layout with every decoder layer's (trunk and MTP) input and post-attention RMSNorm
    weight 1 + w folded into the columns of the fused projection that reads it, the norm weights set to
    None: the layer then hands its products a `norms.DeferredNorm` (x and its 1/rms), and a single-token
    step applies 1/rms after the product, with no scale-and-cast kernel in front of it. Fuses first (`fuse_projections`); idempotent. The folded weight is
    rounded once to the weight dtype, where the unfolded form rounds the normed activation instead."""
    params = fuse_projections(params)

    def fold(p, norm):
        wide = jnp.promote_types(p.fused.dtype, jnp.float32)
        scale = 1.0 + norm.astype(wide)
        return dataclasses.replace(p, fused=(p.fused.astype(wide) * scale).astype(p.fused.dtype))

    def fold_layer(layer: DecoderLayerParams) -> DecoderLayerParams:
        if layer.input_layernorm is None:
            return layer
        return dataclasses.replace(layer, input_layernorm=None, post_attention_layernorm=None,
                                   mixer=fold(layer.mixer, layer.input_layernorm),
                                   mlp=fold(layer.mlp, layer.post_attention_layernorm))

    mtp = params.mtp
    if mtp is not None:
        mtp = dataclasses.replace(mtp, layers=tuple(map(fold_layer, mtp.layers)))
    return dataclasses.replace(params, layers=tuple(map(fold_layer, params.layers)), mtp=mtp)


def serving_layout(params: ModelParams, fold: bool = True) -> ModelParams:
    """The weights an engine serves: fold_norms(params), or fuse_projections(params) with fold=False."""
    return fold_norms(params) if fold else fuse_projections(params)


# ------------------------------------------------------------------------------------- name <-> shape
def _mixer_shapes(cfg: ModelConfig, layer_type: str) -> dict[str, tuple[int, ...]]:
    H, D = cfg.hidden_size, cfg.head_dim
    if layer_type == FULL_ATTENTION:
        return {
            "self_attn.q_proj.weight": (2 * cfg.num_attention_heads * D, H),
            "self_attn.k_proj.weight": (cfg.num_key_value_heads * D, H),
            "self_attn.v_proj.weight": (cfg.num_key_value_heads * D, H),
            "self_attn.o_proj.weight": (H, cfg.num_attention_heads * D),
            "self_attn.q_norm.weight": (D,),
            "self_attn.k_norm.weight": (D,),
        }
    Hv = cfg.linear_num_value_heads
    return {
        "linear_attn.in_proj_qkv.weight": (cfg.conv_dim, H),
        "linear_attn.in_proj_z.weight": (cfg.linear_value_dim, H),
        "linear_attn.in_proj_b.weight": (Hv, H),
        "linear_attn.in_proj_a.weight": (Hv, H),
        "linear_attn.conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
        "linear_attn.dt_bias": (Hv,),
        "linear_attn.A_log": (Hv,),
        "linear_attn.norm.weight": (cfg.linear_value_head_dim,),
        "linear_attn.out_proj.weight": (H, cfg.linear_value_dim),
    }


def _layer_shapes(cfg: ModelConfig, layer_type: str) -> dict[str, tuple[int, ...]]:
    H, I = cfg.hidden_size, cfg.intermediate_size
    return {
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        **_mixer_shapes(cfg, layer_type),
        "mlp.gate_proj.weight": (I, H),
        "mlp.up_proj.weight": (I, H),
        "mlp.down_proj.weight": (H, I),
    }


def expected_tensor_shapes(cfg: ModelConfig, include_mtp: bool | None = None) -> dict[str, tuple[int, ...]]:
    """Canonical tensor names (text-only layout: `model.*`, `lm_head`, `mtp.*`) -> HF shapes."""
    include_mtp = cfg.has_mtp if include_mtp is None else include_mtp
    H = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H)}
    for i, layer_type in enumerate(cfg.layer_types):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in _layer_shapes(cfg, layer_type).items()})
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    if include_mtp:
        shapes["mtp.pre_fc_norm_embedding.weight"] = (H,)
        shapes["mtp.pre_fc_norm_hidden.weight"] = (H,)
        shapes["mtp.fc.weight"] = (H, 2 * H)
        for i in range(cfg.mtp_num_hidden_layers):
            shapes.update({f"mtp.layers.{i}.{k}": v for k, v in _layer_shapes(cfg, FULL_ATTENTION).items()})
        shapes["mtp.norm.weight"] = (H,)
    return shapes


def tensor_dtype(name: str, weight_dtype) -> jnp.dtype:
    """The dtype jaxgdn keeps a tensor in: fp32 for A_log and the gated-norm weight, else weight_dtype."""
    return jnp.float32 if name.endswith(FP32_TENSOR_SUFFIXES) else jnp.dtype(weight_dtype)


# ------------------------------------------------------------------------------------- build / flatten
def _build_layer(get: Callable[[str], Array], prefix: str, layer_type: str) -> DecoderLayerParams:
    if layer_type == FULL_ATTENTION:
        a = prefix + "self_attn."
        mixer = AttentionParams(
            q_proj=get(a + "q_proj.weight"),
            k_proj=get(a + "k_proj.weight"),
            v_proj=get(a + "v_proj.weight"),
            o_proj=get(a + "o_proj.weight"),
            q_norm=get(a + "q_norm.weight"),
            k_norm=get(a + "k_norm.weight"),
        )
    else:
        g = prefix + "linear_attn."
        mixer = GDNParams(
            in_proj_qkv=get(g + "in_proj_qkv.weight"),
            in_proj_z=get(g + "in_proj_z.weight"),
            in_proj_b=get(g + "in_proj_b.weight"),
            in_proj_a=get(g + "in_proj_a.weight"),
            conv1d=get(g + "conv1d.weight"),
            dt_bias=get(g + "dt_bias"),
            A_log=get(g + "A_log"),
            norm=get(g + "norm.weight"),
            out_proj=get(g + "out_proj.weight"),
        )
    return DecoderLayerParams(
        input_layernorm=get(prefix + "input_layernorm.weight"),
        post_attention_layernorm=get(prefix + "post_attention_layernorm.weight"),
        mixer=mixer,
        mlp=MLPParams(
            gate_proj=get(prefix + "mlp.gate_proj.weight"),
            up_proj=get(prefix + "mlp.up_proj.weight"),
            down_proj=get(prefix + "mlp.down_proj.weight"),
        ),
    )


def params_from_tensors(cfg: ModelConfig, tensors: dict[str, Array], include_mtp: bool) -> ModelParams:
    """Assemble ModelParams from canonical-name tensors (already validated and cast)."""
    get = tensors.__getitem__
    layers = tuple(_build_layer(get, f"model.layers.{i}.", t) for i, t in enumerate(cfg.layer_types))
    mtp = None
    if include_mtp:
        mtp = MTPParams(
            pre_fc_norm_embedding=get("mtp.pre_fc_norm_embedding.weight"),
            pre_fc_norm_hidden=get("mtp.pre_fc_norm_hidden.weight"),
            fc=get("mtp.fc.weight"),
            layers=tuple(
                _build_layer(get, f"mtp.layers.{i}.", FULL_ATTENTION) for i in range(cfg.mtp_num_hidden_layers)
            ),
            norm=get("mtp.norm.weight"),
        )
    return ModelParams(
        embed_tokens=get("model.embed_tokens.weight"),
        layers=layers,
        norm=get("model.norm.weight"),
        lm_head=None if cfg.tie_word_embeddings else get("lm_head.weight"),
        mtp=mtp,
    )


def params_to_tensors(cfg: ModelConfig, params: ModelParams) -> dict[str, Array]:
    """Inverse of params_from_tensors: canonical name -> array."""
    # Building with a mapping whose lookups return the key gives a pytree of tensor names with the
    # same structure as `params`, so the flattening needs no second hand-written map.
    names = params_from_tensors(cfg, _KeyEcho(), include_mtp=params.mtp is not None)
    name_leaves = jax.tree_util.tree_leaves(names)
    value_leaves = jax.tree_util.tree_leaves(params)
    if len(name_leaves) != len(value_leaves):
        raise ValueError("params do not match the config (different number of tensors)")
    return dict(zip(name_leaves, value_leaves))


def cast_params(cfg: ModelConfig, params: ModelParams, weight_dtype) -> ModelParams:
    """params with jaxgdn's dtype policy applied (fp32 A_log / gated norm, weight_dtype elsewhere);
    traceable, so training can keep fp32 master weights and run the forward in bf16."""
    tensors = {name: x.astype(tensor_dtype(name, weight_dtype)) for name, x in params_to_tensors(cfg, params).items()}
    return params_from_tensors(cfg, tensors, include_mtp=params.mtp is not None)


class _KeyEcho(dict):
    """A mapping whose lookups return the key itself."""

    def __getitem__(self, key: str) -> str:
        return key


def _distribution(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> tuple:
    """How init_random_params draws a tensor: ("log_uniform", low, high) or ("normal", loc, mul, div), the value
    loc + mul * N(0, 1) / div."""
    if name.endswith("A_log"):
        return ("log_uniform", 0.05, 1.0)
    if name.endswith("linear_attn.norm.weight"):
        return ("normal", 1.0, 0.1, 1.0)
    if name.endswith("dt_bias"):
        return ("normal", 0.0, 0.5, 1.0)
    if len(shape) == 1:
        return ("normal", 0.0, 0.1, 1.0)
    if name.endswith(RESIDUAL_OUTPUT_PROJECTIONS):
        # GPT-2's residual scaling keeps each block's Jacobian near 1, so fp32 rounding does not
        # double per layer and parity tests can use tight tolerances.
        return ("normal", 0.0, 1.0, np.sqrt(shape[-1] * 2 * cfg.num_hidden_layers))
    # linears and the conv taps over their fan-in (the last axis); embeddings over H, for logits of O(1)
    return ("normal", 0.0, 1.0, np.sqrt(shape[-1]))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _draw_on_device(key, index, shape: tuple[int, ...], distribution: tuple, dtype: str) -> Array:
    """One tensor of init_random_params' on-device draw, from fold_in(key, index): one small program per
    distinct (shape, distribution, dtype), where eager ops would compile each op of each new shape apart."""
    k = jax.random.fold_in(key, index)
    kind, *args = distribution
    if kind == "log_uniform":
        return jnp.log(jax.random.uniform(k, shape, jnp.float32, *args)).astype(dtype)
    loc, mul, div = args
    return (loc + mul * jax.random.normal(k, shape, jnp.float32) / div).astype(dtype)


def init_random_params(
    cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, include_mtp: bool | None = None, on_device: bool = False
) -> ModelParams:
    """Random weights with O(1) activations: every tensor random, none at HF's init values.

    Linears ~ N(0, 1/fan_in), residual output projections / (2 * layers); (1+w) norm offsets ~ N(0, 0.1); gated-norm w ~ 1 + N(0, 0.1);
    A_log = log U(0.05, 1) (strong decays of |g| >> 1 make fp32 itself, HF's included, lose ~1e-3
    on logits, so parity tests could not tell bugs from rounding); dt_bias ~ N(0, 0.5); conv taps ~ N(0, 1/Kc); embeddings ~ N(0, 1/H).
    on_device: drawn with jax.random on the default device (the same distributions, other values): seconds
    for the largest presets, where numpy's draw on the host takes minutes.
    """
    specs = tuple((name, shape, _distribution(cfg, name, shape), jnp.dtype(tensor_dtype(name, dtype)).name)
                  for name, shape in expected_tensor_shapes(cfg, include_mtp).items())
    if on_device:
        key = jax.random.key(seed)
        tensors = {name: _draw_on_device(key, i, *spec) for i, (name, *spec) in enumerate(specs)}
    else:
        rng = np.random.default_rng(seed)
        tensors = {}
        for name, shape, (kind, *args), dt in specs:
            if kind == "log_uniform":
                x = np.log(rng.uniform(*args, shape))
            else:
                loc, mul, div = args
                x = loc + mul * rng.standard_normal(shape) / div
            tensors[name] = jnp.asarray(x, dtype=dt)
    return params_from_tensors(cfg, tensors, include_mtp=cfg.has_mtp if include_mtp is None else include_mtp)
