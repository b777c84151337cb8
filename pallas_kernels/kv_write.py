"""The KV write of a step: each token's K/V into the paged pools at its flat slot, in place.

    k_pool, v_pool [P, ps, Hkv, D]   the pools; page 0 is the null page
    slots [N]                        flat pool slot of each token (page * ps + offset)
    k, v [N, Hkv, D]                 this step's keys and values

One program per token. XLA's scatter did the same but, in the 4-steps-per-launch decode program on the
H200, some of its KV scatters cost as much as copying the whole pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import interpret_default, triton_params


def _write_kernel(slot_ref, k_ref, v_ref, _k_in, _v_in, k_pool_ref, v_pool_ref):
    n = pl.program_id(0)
    slot = slot_ref[n]
    k_pool_ref[slot, :] = k_ref[n, :].astype(k_pool_ref.dtype)
    v_pool_ref[slot, :] = v_ref[n, :].astype(v_pool_ref.dtype)


def write_kv_pallas(k_pool, v_pool, slots, k, v, interpret=None, num_warps: int = 2):
    """k_pool, v_pool [P, ps, Hkv, D]; slots [N] flat pool slots (page * ps + offset); k, v [N, Hkv, D].
    Returns the pools with token n's K/V at slots[n], written in place (the pools are aliased to the
    outputs). Tokens may share only the null page's slots (padding): what lands there is never read."""
    P, ps, Hkv, D = k_pool.shape
    assert write_kernel_supports(Hkv, D), (Hkv, D)
    flat = lambda x: x.reshape(-1, Hkv * D)  # noqa: E731
    pool_shape = jax.ShapeDtypeStruct((P * ps, Hkv * D), k_pool.dtype)
    k_new, v_new = pl.pallas_call(
        _write_kernel, out_shape=(pool_shape, pool_shape), grid=(slots.shape[0],), input_output_aliases={3: 0, 4: 1},
        interpret=interpret_default(interpret),
        compiler_params=triton_params(num_warps),
    )(slots.astype(jnp.int32), flat(k), flat(v), flat(k_pool), flat(v_pool))
    return k_new.reshape(k_pool.shape), v_new.reshape(v_pool.shape)


def write_kernel_supports(num_kv_heads: int, head_dim: int) -> bool:
    """A token's K (Hkv * D values) must be one Triton tile: a power of two >= 16."""
    n = num_kv_heads * head_dim
    return n >= 16 and n == pl.next_power_of_2(n)
