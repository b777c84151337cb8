"""`bench kernels`: the GDN recurrence kernels serving runs against fla's Triton kernels (same run, same inputs)
and the roofline.

Prefill: `gdn_ragged_chunked` over B rows of T tokens (the stream with query_start_loc = arange(B + 1) * T) vs fla
`chunk_gated_delta_rule` (and our XLA chunked form). Ours stores o in fp32, as serving does; fla returns it in
bf16 (the "floor bytes" column counts the difference).
Decode / verify: `gdn_recurrent_pooled` (T = 1, and T = 1+K writing a checkpoint per position) vs fla
`fused_recurrent_gated_delta_rule` (which writes only the final state). Both of ours read and write the
engine's state pool in place: each call starts from the state the previous call wrote, the pool donated, as
in a served step. Both sides are checked against each other before they are timed: a kernel that is fast and
wrong is reported as wrong.

Two times per side: ms per call issued back to back from Python (what a caller sees, launch path
included; fla's varies between runs at short shapes) and the summed device time of the kernels one call
runs (JAX's profiler for ours, torch's for fla, each call's kernels only: no launch gaps). The device
ratio compares the kernels themselves. The profiles run after every timed row (a profiler attached to
the process may slow later launches) and fla's after all of ours (see torch_kernel_us).
"""

from __future__ import annotations

import numpy as np

from .common import (
    ensure_triton_cache_dir,
    measured_bandwidth_gbs,
    profile_calls,
    time_jax,
    time_torch,
    torch_kernel_us,
)

PREFILL_SHAPES = ((1, 4096), (1, 16384), (8, 2048))
DECODE_SHAPES = ((1, 1), (64, 1), (64, 2), (64, 3), (64, 4))


def _inputs(B, T, H, d, seed=0):
    """bf16 q, k, v; fp32 log decay g <= 0 and beta in (0, 1); fp32 initial state (numpy)."""
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal((B, T, H, d)).astype(np.float32) for _ in range(3))
    g = np.log(1 / (1 + np.exp(-r.standard_normal((B, T, H)) - 3))).astype(np.float32)  # log sigmoid: mild decay
    beta = (1 / (1 + np.exp(-r.standard_normal((B, T, H))))).astype(np.float32)
    s0 = (0.1 * r.standard_normal((B, H, d, d))).astype(np.float32)
    return q, k, v, g, beta, s0


def kernel_bytes(B, T, H, d, checkpoints=False, o_bytes=4):
    """Bytes that must move: q, k, v bf16 in, g and beta fp32 in, o out (o_bytes per value: fp32 for ours and
    fla's recurrent kernel, bf16 for fla's chunked prefill), state fp32 in and out (and one
    fp32 state per position for verify checkpoints, which fla's fused recurrent kernel does not write: at
    B64 T2..4 they make ours 2-3x fla's floor, tables.kernels_table's "floor bytes" column)."""
    n = B * T * H
    state = B * H * d * d * 4
    return n * d * 2 * 3 + n * 8 + n * d * o_bytes + 2 * state + (B * T * H * d * d * 4 if checkpoints else 0)


def _rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


class PooledCall:
    """One of our serving kernels as a served step calls it: the state pool [B+1, W, H, d, d] (slot 0 the null
    slot) passed in and donated, the updated pool kept for the next call. call() -> o; `pool` holds the
    states."""

    def __init__(self, kernel, inputs: tuple, s0, W: int, verify: bool):
        import jax
        import jax.numpy as jnp

        B = s0.shape[0]
        self.pool = jnp.zeros((B + 1, W, *s0.shape[1:]), jnp.float32).at[1:, 0].set(s0)
        self.rows = (jnp.arange(1, B + 1, dtype=jnp.int32), jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool),
                     jnp.full((B,), verify))
        self.inputs = inputs
        self.fn = jax.jit(kernel, donate_argnums=len(inputs))

    def __call__(self):
        o, self.pool = self.fn(*self.inputs, self.pool, *self.rows)
        return o


def serving_prefill(q, k, v, g, beta, s0):
    """`gdn_ragged_chunked` over dense rows: [B, T] inputs as the stream of B rows of T tokens."""
    from pallas_kernels.gdn_ragged_chunked import gdn_ragged_chunked

    B, T = q.shape[:2]
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731

    def kernel(q, k, v, g, beta, pool, slots, start, fresh, verify):
        import jax.numpy as jnp

        qsl = jnp.arange(B + 1, dtype=jnp.int32) * T
        return gdn_ragged_chunked(q, k, v, g, beta, pool, qsl, slots, start, fresh, verify)

    call = PooledCall(kernel, tuple(flat(x) for x in (q, k, v, g, beta)), s0, 1, False)
    return call, lambda o: o.reshape(B, T, *o.shape[1:]), lambda: call.pool[1:, 0]


def serving_decode(q, k, v, g, beta, s0):
    """`gdn_recurrent_pooled` on B rows of T tokens; T > 1 a verify window writing a checkpoint per position."""
    import jax.numpy as jnp

    from pallas_kernels.gdn_decode import gdn_recurrent_pooled

    B, T = q.shape[:2]
    qkv = jnp.concatenate([x.reshape(B, T, -1) for x in (q, k, v)], axis=-1)
    call = PooledCall(gdn_recurrent_pooled, (qkv, g, beta), s0, T, T > 1)
    return call, lambda o: o, lambda: call.pool[1:, T - 1]


def bench_kernels(args) -> dict:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gdn_reference import gdn_chunked_reference, gdn_recurrent_checkpoints

    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        have_fla = torch.cuda.is_available()
    except Exception as e:  # noqa: BLE001
        print(f"fla unavailable ({type(e).__name__}: {e}); timing our kernels only")
        have_fla = False

    H, d = args.heads, args.head_dim
    bw = measured_bandwidth_gbs(args.bandwidth_bytes)
    print(f"measured bandwidth: {bw:.0f} GB/s (bf16 elementwise read+write)")
    rows = []
    profiled = []  # (row, our call, fla's call or None): profiled after the timing

    def to_jax(x, bf16):
        return jnp.asarray(x, jnp.bfloat16 if bf16 else jnp.float32)

    def to_torch(x, bf16):
        return torch.tensor(x, device="cuda", dtype=torch.bfloat16 if bf16 else torch.float32)

    def run_case(kind, B, T):
        q, k, v, g, beta, s0 = _inputs(B, T, H, d, seed=B * 7 + T)
        beta = np.asarray(jnp.asarray(beta, jnp.bfloat16).astype(jnp.float32))  # fla gets bf16 beta: same values
        jq, jk, jv = (to_jax(x, True) for x in (q, k, v))
        jg, jb, js = (to_jax(x, False) for x in (g, beta, s0))
        row = {"kind": kind, "B": B, "T": T, "H": H, "d": d}
        serving = serving_prefill if kind == "prefill" else serving_decode
        ours, dense_o, final_state = serving(jq, jk, jv, jg, jb, js)
        o = dense_o(ours())
        s = final_state()  # the state after the one call (a verify window's last checkpoint)
        if kind == "prefill":
            xla = jax.jit(gdn_chunked_reference)
            o_x, s_x = xla(jq, jk, jv, jg, jb, js)
            row["ours_ms"] = time_jax(ours)
            row["xla_chunked_ms"] = time_jax(xla, jq, jk, jv, jg, jb, js)
            nbytes = kernel_bytes(B, T, H, d)
        else:
            keep = T > 1  # verify windows write a checkpoint per position
            xla = jax.jit(gdn_recurrent_checkpoints)
            o_x, s_x, _ = xla(jq, jk, jv, jg, jb, js)
            row["checkpoints_written"] = keep
            row["ours_ms"] = time_jax(ours, iters=100)
            row["xla_scan_ms"] = time_jax(xla, jq, jk, jv, jg, jb, js, iters=100)
            nbytes = kernel_bytes(B, T, H, d, checkpoints=keep)
        row["ours_vs_xla_rel_err"] = max(_rel_err(o, o_x), _rel_err(s, s_x))
        row["roofline_ms"] = nbytes / (bw * 1e9) * 1e3
        if have_fla:
            tq, tk, tv = (to_torch(x, True) for x in (q, k, v))
            tg, tb, ts = to_torch(g, False), to_torch(beta, True), to_torch(s0, False)
            fn = chunk_gated_delta_rule if kind == "prefill" else fused_recurrent_gated_delta_rule

            def fla_call():
                return fn(tq, tk, tv, g=tg, beta=tb, initial_state=ts, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)

            ensure_triton_cache_dir()  # as in bench prefill: found missing after our kernels had run
            with torch.no_grad():
                fo, fs = fla_call()
                # fla computes with bf16 beta; compare with ours fed the same rounded beta.
                row["ours_vs_fla_rel_err"] = max(_rel_err(o, fo.float().cpu().numpy()),
                                                 _rel_err(s, fs.float().cpu().numpy()))
                row["fla_ms"] = time_torch(fla_call, iters=100 if kind != "prefill" else 20)
            row["ratio_ours_over_fla"] = row["ours_ms"] / row["fla_ms"]
        profiled.append((row, ours, fla_call if have_fla else None))
        rows.append(row)
        args.save_partial(payload())
        fla = f"fla {row['fla_ms']:.3f} ms  ratio {row['ratio_ours_over_fla']:.2f}" if have_fla else "fla -"
        ref = row.get("xla_chunked_ms", row.get("xla_scan_ms"))
        print(f"{kind:8s} B{B:<3d} T{T:<6d} ours {row['ours_ms']:.3f} ms  {fla}  xla {ref:.3f} ms  "
              f"roofline {row['roofline_ms']:.3f} ms  err vs xla {row['ours_vs_xla_rel_err']:.1e}"
              + (f" vs fla {row['ours_vs_fla_rel_err']:.1e}" if have_fla else ""), flush=True)

    def payload():
        return {"benchmark": "kernels", "bandwidth_gbs": bw, "dtype": "bf16 q/k/v, fp32 g/beta/state",
                "timing": "ms per call, back-to-back calls, median of 5 runs (launch overhead included); "
                          "*_device_us: summed device time of one call's kernels (profilers)",
                "rows": rows}

    for B, T in args.prefill_shapes or PREFILL_SHAPES:
        run_case("prefill", B, T)
    for B, T in args.decode_shapes or DECODE_SHAPES:
        run_case("decode" if T == 1 else "verify", B, T)
    for row, ours_call, _ in profiled:
        row["ours_device_us"] = device_us(lambda: profile_calls(ours_call)["busy_us"])
    for row, _, fla_call in profiled:
        if fla_call is not None:
            with torch.no_grad():
                row["fla_device_us"] = device_us(lambda: sum(torch_kernel_us(fla_call).values()))
            if row["ours_device_us"] and row["fla_device_us"]:
                row["device_ratio_ours_over_fla"] = row["ours_device_us"] / row["fla_device_us"]
        print(f"{row['kind']:8s} B{row['B']:<3d} T{row['T']:<6d} kernels: ours {row['ours_device_us']} us  "
              f"fla {row.get('fla_device_us')} us  ratio {row.get('device_ratio_ours_over_fla')}", flush=True)
    return payload()


def device_us(measure):
    """measure() rounded to 0.1 µs, or None when the profiler gives nothing (the row keeps its other
    figures: a profiler that cannot attach must not lose the timed results)."""
    try:
        us = measure()
    except Exception as e:  # noqa: BLE001
        print(f"device time unavailable: {type(e).__name__}: {e}")
        return None
    return round(us, 1) if us else None
