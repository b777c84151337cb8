"""The GDN layer's causal conv + SiLU: over a ragged step's stream in XLA (`ragged_causal_conv`, every ragged
step's, GPU included), and as a Pallas kernel over the engine's conv-window pool in place for short rows
(`causal_conv_pooled`, decode and verify), with the row helpers the GDN mixer kernel shares.

The XLA form of a short-row step would gather each row's window from the pool, concatenate it with the new
inputs, convolve, and scatter the new window back: four or five kernels per GDN layer, and a scatter that XLA
runs slowly at large batches. The pool kernel does all of it in one pass, one program per (row, channel
block), each program owning its channels, so reading the old window and writing the new one in place never
races.

    x      [B, T, >=C]     pre-conv inputs q‖k‖v in channels [0, C) (the fused projection's whole output
                           may be passed: its other channels are never read, and no sliced copy is made)
    weight [C, 1, Kc]      depthwise taps, tap Kc-1 on the current token
    pool   [S, Kc-1+K, C]  conv-window pool; a row's window is at checkpoint offset `start`
    slots, start, fresh, verify, num_valid [B]
    -> (silu(conv) [B, T, C] in x.dtype, updated pool)

Semantics (tests/test_gdn_conv.py compares them with the engine's XLA path): with
full = [window ‖ x[:T]] (window zeros for a fresh row), output t is silu(Σ_j full[t+j] · w[:, j]) in fp32;
a verify row writes full[1 : Kc+K] (the window after each window position) to offsets 0..Kc-2+K; any
other row writes its last Kc-1 real inputs full[n : n+Kc-1] (n = num_valid) to offsets 0..Kc-2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import interpret_default, triton_params
from .gdn_common import row_offsets

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


def ragged_causal_conv(x, weight, windows, token_row, query_start_loc, num_windows: int):
    """Depthwise causal conv + SiLU of each row of a ragged stream over [window ‖ its tokens], in XLA.

    x [T, >=C] (channels [0, C) read), weight [C, 1, Kc], windows [R, Kc-1, C], token_row [T] (-1: padding),
    query_start_loc [R+1] -> silu(conv) [T, C] in x's dtype (sums in fp32), the windows after each row
    [R, Kc-1, C], and the inputs 1 .. Kc-2+W of [window ‖ row] [R, Kc-2+W, C] (W = num_windows: a verify
    row's windows after each of its first W tokens, the one after token i being [i : i+Kc-1])."""
    C, _, Kc = weight.shape
    T = x.shape[0]
    x = x[:, :C]
    windows = windows.astype(x.dtype)
    w = weight[:, 0, :].astype(jnp.promote_types(x.dtype, f32))  # [C, Kc]
    valid, row, offset = row_offsets(token_row, query_start_loc)
    padded = jnp.pad(x, [(Kc - 1, 0), (0, 0)])
    acc = 0.0
    for j in range(Kc):
        s = offset - (Kc - 1) + j  # the tap's input, as an offset in the row (negative: in the window)
        from_window = windows[row, jnp.clip(Kc - 1 + s, 0, Kc - 2)]
        tap = jnp.where((s >= 0)[:, None], padded[j : j + T], from_window)
        acc = acc + tap.astype(w.dtype) * w[:, j]
    out = jnp.where(valid[:, None], jax.nn.silu(acc), 0).astype(x.dtype)

    n = query_start_loc[1:] - query_start_loc[:-1]  # [R]

    def full_at(m):  # [R, E] indices into each row's [window ‖ tokens] -> [R, E, C]
        from_window = jnp.take_along_axis(windows, jnp.clip(m, 0, Kc - 2)[..., None], axis=1)
        from_tokens = x[jnp.clip(query_start_loc[:-1, None] + m - (Kc - 1), 0, T - 1)]
        return jnp.where((m < Kc - 1)[..., None], from_window, from_tokens)

    after = full_at(n[:, None] + jnp.arange(Kc - 1))
    buffers = full_at(1 + jnp.arange(Kc - 2 + num_windows)[None, :] + jnp.zeros_like(n)[:, None])
    return out, after, buffers
