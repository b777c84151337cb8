"""Pallas kernels of the GDN layer's causal conv + SiLU: over the engine's conv-window pool, in place, for
short rows (`causal_conv_pooled`, below), and over whole long rows written straight into q, k and v
(`causal_conv_prompt`, at the end of the file).

The XLA path of an engine step gathers each row's window from the pool, concatenates it with the new
inputs, convolves, and scatters the new window back: four or five kernels per GDN layer, and a scatter
that XLA runs slowly at large batches. This kernel does all of it in one pass, one program per (row,
channel block), each program owning its channels, so reading the old window and writing the new one in
place never races.

    x      [B, T, >=C]     pre-conv inputs q‖k‖v in channels [0, C) (the fused projection's whole output
                           may be passed: its other channels are never read, and no sliced copy is made)
    weight [C, 1, Kc]      depthwise taps, tap Kc-1 on the current token
    pool   [S, Kc-1+K, C]  conv-window pool; a row's window is at checkpoint offset `start`
    slots, start, fresh, verify, num_valid [B]
    -> (silu(conv) [B, T, C] in x.dtype, updated pool)

Semantics (those of `jaxgdn.paged_forward`'s XLA path, which the tests compare against): with
full = [window ‖ x[:T]] (window zeros for a fresh row), output t is silu(Σ_j full[t+j] · w[:, j]) in fp32;
a verify row writes full[1 : Kc+K] (the window after each window position) to offsets 0..Kc-2+K; any
other row writes its last Kc-1 real inputs full[n : n+Kc-1] (n = num_valid) to offsets 0..Kc-2.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import interpret_default, triton_params

f32 = jnp.float32
MAX_CHANNEL_BLOCK = 256


def conv_kernel_supports(channels: int) -> bool:
    """Channels must split into power-of-two blocks of at least 16 (Triton tiles)."""
    return channels % 16 == 0


def _channel_block(channels: int) -> int:
    bc = MAX_CHANNEL_BLOCK
    while channels % bc:
        bc //= 2
    return bc


def _conv_kernel(x_ref, w_ref, slot_ref, start_ref, fresh_ref, verify_ref, nvalid_ref, _pool_in, o_ref, pool_ref,
                 *, T, Kc, BC):
    b, ic = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(ic * BC, BC)
    slot, start = slot_ref[b], start_ref[b]
    fresh = fresh_ref[b] != 0
    window = [jnp.where(fresh, 0, pool_ref[slot, start + i, cols]).astype(x_ref.dtype) for i in range(Kc - 1)]
    full = window + [x_ref[b, jnp.int32(t), cols] for t in range(T)]  # Kc-1+T rows of [BC]; T is small and static
    for t, out in enumerate(conv_silu_rows(full, w_ref, cols, T)):
        o_ref[b, jnp.int32(t), cols] = out.astype(o_ref.dtype)
    # Every load above precedes these stores in the program, and no other program touches these channels.
    store_windows(pool_ref, slot, cols, full, Kc, T, nvalid_ref[b], verify_ref[b] != 0)


def conv_silu_rows(full, w_ref, cols, T: int):
    """The T outputs silu(Σ_j full[t+j] · w[:, j]) [width] fp32 of a row's input rows full = [window ‖ x]
    (Kc-1+T rows of [width]) for channels `cols` of the taps w_ref [C, 1, Kc]."""
    Kc = w_ref.shape[-1]
    w = [w_ref[cols, jnp.int32(0), jnp.int32(j)].astype(f32) for j in range(Kc)]
    outs = []
    for t in range(T):
        acc = sum(full[t + j].astype(f32) * w[j] for j in range(Kc))
        outs.append(acc * jax.nn.sigmoid(acc))
    return outs


def store_windows(pool_ref, slot, cols, full, Kc: int, T: int, n, verify):
    """Write a row's conv windows for channels `cols` into pool_ref [S, Kc-1+K, C] in place: full is the
    list of its Kc-1+T input rows [window ‖ x] ([width] each); a verify row writes full[1 : Kc+K] (the
    window after each window position), any other row its last Kc-1 real inputs full[n : n+Kc-1]."""
    from jax.experimental.pallas import triton as plt  # masked stores (also in interpret mode)

    width = full[0].shape[0]
    for i in range(pool_ref.shape[1]):
        kept = None
        if i < Kc - 1:  # the last Kc-1 real inputs: full[n + i]
            kept = full[i]
            for m in range(1, T + 1):
                kept = jnp.where(n == m, full[m + i], kept)
        buffer = full[1 + i] if 1 + i < len(full) else None  # verify rows: the window after each position
        if kept is None and buffer is None:
            continue
        if kept is None:
            value, mask = buffer, verify
        elif buffer is None:
            value, mask = kept, jnp.logical_not(verify)
        else:
            value, mask = jnp.where(verify, buffer, kept), jnp.bool_(True)
        plt.store(pool_ref.at[slot, jnp.int32(i), cols], value.astype(pool_ref.dtype), mask=jnp.full((width,), mask))


def causal_conv_pooled(x, channels: int, weight, pool, slots, start, fresh, verify, num_valid, interpret=None,
                       num_warps: int = 4):
    """Causal conv + SiLU of rows starting from their window in the pool; writes the new windows in place.
    Shapes and semantics in the module docstring. Rows must use distinct slots (padding rows may share the
    null slot: what they write there is never read)."""
    B, T, _ = x.shape
    Kc = weight.shape[-1]
    assert conv_kernel_supports(channels), channels
    assert pool.shape[2] == channels and pool.shape[1] >= Kc - 1, (pool.shape, channels, Kc)
    BC = _channel_block(channels)
    i32 = lambda a: jnp.asarray(a).astype(jnp.int32)  # noqa: E731
    kernel = functools.partial(_conv_kernel, T=T, Kc=Kc, BC=BC)
    return pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((B, T, channels), x.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        grid=(B, channels // BC), input_output_aliases={7: 1}, interpret=interpret_default(interpret),
        compiler_params=triton_params(num_warps),
    )(x, weight, i32(slots), i32(start), i32(fresh), i32(verify), i32(num_valid), pool)


# ----------------------------------------------------------------------------- whole prompts (prefill)


def _prompt_conv_kernel(x_ref, w_ref, win_ref, *o_refs, T, Kc, BT, BC, bounds):
    """One (row, tile of BT outputs, channel block): outputs t0 .. t0+BT-1, tap j reading input rows
    t0+j-(Kc-1) ..; the first tile's rows before 0 come from the window (its own code path, so the other
    tiles load nothing extra). The channel block lies inside one of the outputs (q, k, v): the others'
    stores are masked."""
    from jax.experimental.pallas import triton as plt  # masked loads and stores (also in interpret mode)

    b, it, ic = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t0, c0 = it * BT, ic * BC
    cols = pl.ds(c0, BC)
    out_rows = t0 + jnp.arange(BT)

    def conv(first: bool):
        acc = jnp.zeros((BT, BC), f32)
        ch = (c0 + jnp.arange(BC))[None, :] if first else None  # channel index array for the gathers
        for j in range(Kc):
            back = Kc - 1 - j  # tap j of output t reads input t - back
            if first:  # tile 0: t < back reads the window's row Kc-1+t-back (gathered loads, this tile only)
                xj = x_ref[b, jnp.clip(out_rows - back, 0, T - 1)[:, None], ch].astype(f32)
                wj = win_ref[b, jnp.clip(Kc - 1 + out_rows - back, 0, Kc - 2)[:, None], ch]
                xj = jnp.where((out_rows < back)[:, None], wj.astype(x_ref.dtype).astype(f32), xj)
            else:  # rows t0-back.. all >= 0 (BT >= Kc-1)
                mask = jnp.broadcast_to((out_rows - back < T)[:, None], (BT, BC))
                xj = plt.load(x_ref.at[b, pl.ds(t0 - back, BT), cols], mask=mask, other=0).astype(f32)
            acc += xj * w_ref[j, cols].astype(f32)[None, :]
        return acc * jax.nn.sigmoid(acc)

    def store(out):
        row_ok = (out_rows < T)[:, None]
        for o_ref, (lo, hi) in zip(o_refs, bounds):
            start = jnp.clip(c0 - lo, 0, hi - lo - BC)  # in range even where masked off
            plt.store(o_ref.at[b, pl.ds(t0, BT), pl.ds(start, BC)], out.astype(o_ref.dtype),
                      mask=jnp.broadcast_to(row_ok & ((c0 >= lo) & (c0 < hi)), (BT, BC)))

    if Kc == 1:  # no window
        store(conv(False))
        return

    @pl.when(it == 0)
    def _first_tile():
        store(conv(True))

    @pl.when(it > 0)
    def _other_tiles():
        store(conv(False))


def prompt_conv_supports(widths, T: int, Kc: int) -> bool:
    """Every output width splits into channel blocks of >= 16, and the prompt covers the window's reach."""
    return all(w % 16 == 0 for w in widths) and T >= Kc


def causal_conv_prompt(x, widths, weight, window, interpret=None, block_t: int = 16, block_c: int | None = None,
                       num_warps: int = 4):
    """Causal conv + SiLU of a whole prompt, written straight into separate outputs (q, k, v) so no sliced
    copies follow: one read of x and one write of the outputs (XLA's fused conv ran this at about half the
    bandwidth).

    x [B, T, >=C] pre-conv inputs in channels [0, C) (the fused projection's whole output may be passed);
    widths: the outputs' channel counts, summing to C; weight [C, 1, Kc] (tap Kc-1 on the current token);
    window [B, Kc-1, C] the previous inputs. Returns one [B, T, width] array per width, in x.dtype, equal
    to `jaxgdn.model.gdn.causal_conv_silu`'s output split at the widths.
    """
    B, T, _ = x.shape
    Kc = weight.shape[-1]
    C = sum(widths)
    assert prompt_conv_supports(widths, T, Kc) and block_t >= Kc - 1, (widths, T, Kc, block_t)
    BC = block_c or min(MAX_CHANNEL_BLOCK, *(_channel_block(w) for w in widths))
    bounds = tuple((lo, lo + w) for lo, w in zip(itertools.accumulate((0, *widths[:-1])), widths))
    w_taps = weight[:, 0, :].T  # [Kc, C]: one contiguous row per tap
    kernel = functools.partial(_prompt_conv_kernel, T=T, Kc=Kc, BT=block_t, BC=BC, bounds=bounds)
    return pl.pallas_call(
        kernel, out_shape=tuple(jax.ShapeDtypeStruct((B, T, w), x.dtype) for w in widths),
        grid=(B, pl.cdiv(T, block_t), C // BC), interpret=interpret_default(interpret),
        compiler_params=triton_params(num_warps),
    )(x, w_taps, window)
