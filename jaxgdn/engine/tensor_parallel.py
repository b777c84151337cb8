"""Tensor parallelism over a 1-D mesh axis "tp" with jax.sharding: the layouts and the sharded step.

A step runs per shard under `jax.shard_map` (`sharded_step`), on the shard's block of every weight and pool,
with the all-reduces and gathers of `model/parallel.py`. The split (Megatron's):
  - column-parallel (output rows split): attention q/gate, k, v heads; GDN q, k, v, z, b, a heads and the
    conv channels; the MLP's gate and up columns; the vocabulary of the embedding and the LM head (padded with
    zero rows to a multiple of the shards, which the head masks);
  - row-parallel (input columns split): o_proj, out_proj, down_proj, whose partial sums one all-reduce completes;
  - replicated: norms, the MTP's fc, the step's bookkeeping;
  - the pools by head: KV pages on Hkv, GDN recurrent states on Hv, conv windows on their channels.
A fused projection concatenates several outputs, so its rows are stored shard-major (`shard_major`): shard s's
block is [q_s ‖ k_s ‖ v_s ...], the single-device fused layout of the shard's heads (`local_config`). The
conv windows follow the same channel order; a PD handoff carries them in the single-device order
(`conv_channel_order`), so the two sides of a handoff need not share a mesh size.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..model.config import ModelConfig
from ..model.params import AttentionParams, GDNParams, MLPParams, ModelParams
from .state import EngineState, GDNSlots, GDNSnapshots, PagedKV

TP = "tp"
COLUMNS = P(TP, None)  # [out, in] weights split on their output rows
ROWS = P(None, TP)  # [out, in] weights split on their input columns
REPLICATED = P()


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    """Raise a ValueError naming the sizes that tensor_parallel_size tp does not divide."""
    sizes = {"num_key_value_heads": cfg.num_key_value_heads, "linear_num_key_heads": cfg.linear_num_key_heads,
             "linear_num_value_heads": cfg.linear_num_value_heads, "intermediate_size": cfg.intermediate_size}
    bad = [f"{name} {n}" for name, n in sizes.items() if n % tp]
    if tp < 1 or bad:
        raise ValueError(f"EngineConfig: tensor_parallel_size {tp} must divide the model's head counts and MLP "
                         f"width; it does not divide {', '.join(bad) or 'anything below 1'}")


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config one shard's step sees: head counts and the MLP width divided by tp (vocab_size stays the
    whole vocabulary: ids are checked against it)."""
    if tp == 1:
        return cfg
    check_divisible(cfg, tp)
    return cfg.replace(num_attention_heads=cfg.num_attention_heads // tp,
                       num_key_value_heads=cfg.num_key_value_heads // tp,
                       linear_num_key_heads=cfg.linear_num_key_heads // tp,
                       linear_num_value_heads=cfg.linear_num_value_heads // tp,
                       intermediate_size=cfg.intermediate_size // tp)


def make_mesh(devices, tp: int) -> Mesh:
    """A 1-D mesh over the first tp of devices."""
    devices = list(devices)
    if len(devices) < tp:
        raise ValueError(f"EngineConfig: tensor_parallel_size {tp} needs {tp} devices, {len(devices)} available")
    return Mesh(np.array(devices[:tp]), (TP,))


# ------------------------------------------------------------------------------------- weights
def _segments(p, cfg: ModelConfig) -> tuple[int, ...]:
    """Output widths of the projections concatenated in p.fused (params.FUSED_PROJECTIONS order, GDN's qkv
    split into q, k, v)."""
    if isinstance(p, AttentionParams):
        return (2 * cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim,
                cfg.num_key_value_heads * cfg.head_dim)
    if isinstance(p, GDNParams):
        Kd, Vd, Hv = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
        return (Kd, Kd, Vd, Vd, Hv, Hv)
    return (cfg.intermediate_size, cfg.intermediate_size)


def shard_major_order(sizes: tuple[int, ...], tp: int) -> np.ndarray:
    """Index order that stores segments of these sizes shard-major: shard s's block is the s-th tp-th of each
    segment, in segment order."""
    starts = np.cumsum((0,) + sizes[:-1])
    blocks = [np.arange(start + s * (n // tp), start + (s + 1) * (n // tp)) for s in range(tp)
              for start, n in zip(starts, sizes)]
    return np.concatenate(blocks)


def conv_channel_order(cfg: ModelConfig, tp: int) -> np.ndarray:
    """[C]: the single-device conv channel stored at each position of the tp-sharded layout."""
    return shard_major_order((cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim), tp)


def shard_major(params: ModelParams, cfg: ModelConfig, tp: int) -> ModelParams:
    """The serving weights with every fused projection's rows (and the GDN conv channels) stored shard-major, and
    the vocabulary rows padded to a multiple of tp. Needs the fused serving layout (`params.serving_layout`)."""
    if tp == 1:
        return params
    pad = lambda table: None if table is None else np.pad(table, ((0, -table.shape[0] % tp), (0, 0)))  # noqa: E731

    def mixer(p):
        if p.fused is None:
            raise ValueError("tensor parallelism serves the fused layout (params.serving_layout)")
        p = p.replace(fused=p.fused[shard_major_order(_segments(p, cfg), tp)])
        if isinstance(p, GDNParams):
            p = p.replace(conv1d=p.conv1d[conv_channel_order(cfg, tp)])
        return p

    def layer(lp):
        return lp.replace(mixer=mixer(lp.mixer), mlp=mixer(lp.mlp))

    mtp = params.mtp
    if mtp is not None:
        mtp = mtp.replace(layers=tuple(map(layer, mtp.layers)))
    return params.replace(layers=tuple(map(layer, params.layers)), mtp=mtp, embed_tokens=pad(params.embed_tokens),
                          lm_head=pad(params.lm_head))


def param_specs(params: ModelParams) -> ModelParams:
    """A pytree of PartitionSpecs shaped like params (shard_major layout)."""
    rep = lambda tree: jax.tree.map(lambda _: REPLICATED, tree)  # noqa: E731

    def mixer(p):
        if isinstance(p, AttentionParams):
            return rep(p).replace(fused=COLUMNS, o_proj=ROWS)
        if isinstance(p, GDNParams):
            return rep(p).replace(fused=COLUMNS, conv1d=P(TP, None, None), dt_bias=P(TP), A_log=P(TP), out_proj=ROWS)
        assert isinstance(p, MLPParams)
        return rep(p).replace(fused=COLUMNS, down_proj=ROWS)

    def layer(lp):
        return rep(lp).replace(mixer=mixer(lp.mixer), mlp=mixer(lp.mlp))

    mtp = params.mtp
    if mtp is not None:
        mtp = rep(mtp).replace(layers=tuple(map(layer, mtp.layers)))
    head = None if params.lm_head is None else COLUMNS
    return params.replace(embed_tokens=COLUMNS, layers=tuple(map(layer, params.layers)), norm=REPLICATED,
                          lm_head=head, mtp=mtp)


def state_specs(state: EngineState) -> EngineState:
    """A pytree of PartitionSpecs shaped like an EngineState (or a tuple of GDNSnapshots): pools split by head,
    bookkeeping replicated."""
    def pool(x):
        if isinstance(x, PagedKV):
            return PagedKV(k=P(None, None, TP, None), v=P(None, None, TP, None))
        return GDNSlots(conv=P(None, None, TP), ssm=P(None, None, TP, None, None))

    if isinstance(state, tuple):  # the prefix cache's snapshot pools (state.init_snapshots), split as the slots
        return tuple(GDNSnapshots(conv=P(None, None, TP), ssm=P(None, TP, None, None)) for _ in state)
    return dataclasses.replace(jax.tree.map(lambda _: REPLICATED, state), layers=tuple(map(pool, state.layers)),
                               mtp_layers=tuple(map(pool, state.mtp_layers)))


def shardings(mesh: Mesh, specs):
    """NamedShardings of a PartitionSpec pytree."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def place(tree, mesh: Mesh, specs):
    """Global arrays of a host-visible pytree on the mesh; each process supplies its own devices' blocks, so
    this also works when the mesh spans processes (jax.distributed)."""
    def put(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings(mesh, specs))


def sharded_step(step, mesh: Mesh):
    """step(params, state, resident, host_input, *static) run per shard under shard_map: weights and pools
    split as param_specs / state_specs, the input buffers and the result buffer replicated."""

    @functools.wraps(step)
    def run(params, state, resident, host_input, *static):
        body = lambda p, s, r, h: step(p, s, r, h, *static)  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(param_specs(params), state_specs(state), P(), P()),
                             out_specs=(state_specs(state), P(), P(), P(), P()), check_vma=False)(
            params, state, resident, host_input)

    return run


def sharded_parts(fn, mesh: Mesh, kinds: tuple[str, ...], out_kinds):
    """fn(*arrays, *static) run per shard under shard_map: each array argument laid out as its kind says ("params":
    param_specs, "state": state_specs, "rep": replicated), the outputs as out_kinds (a kind or a tuple of them;
    "state" outputs take the layout of the "state" argument)."""

    def run(*args):
        arrays, static = args[: len(kinds)], args[len(kinds):]
        layout = {"params": param_specs, "state": state_specs, "rep": lambda x: P()}
        state = next((x for k, x in zip(kinds, arrays) if k == "state"), None)
        out = lambda k: state_specs(state) if k == "state" else P()  # noqa: E731
        out_specs = out(out_kinds) if isinstance(out_kinds, str) else tuple(out(k) for k in out_kinds)
        in_specs = tuple(layout[k](x) for k, x in zip(kinds, arrays))
        return jax.shard_map(lambda *xs: fn(*xs, *static), mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)(*arrays)

    return run


def mesh_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(mesh.devices.size)
