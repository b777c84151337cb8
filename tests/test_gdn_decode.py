"""The GDN recurrence's decode / verify kernel over the state pool (`gdn_decode.gdn_recurrent_pooled`, interpret
mode on CPU, compiled under -m gpu below) against the scan reference. The one-kernel mixer: test_gdn_mixer.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_test
from test_gdn_reference import random_inputs

from pallas_kernels.gdn_common import GateSource
from pallas_kernels.gdn_decode import gdn_recurrent_pooled
from pallas_kernels.gdn_reference import gdn_recurrent_checkpoints


def pack_qkv(q, k, v):
    """q, k [B, T, Hk, dk], v [B, T, Hv, dv] -> the conv output layout [B, T, q‖k‖v] the pool kernel reads."""
    flat = lambda x: x.reshape(*x.shape[:2], -1)  # noqa: E731
    return jnp.concatenate([flat(q), flat(k), flat(v)], axis=-1)


def max_err(a, b):
    return float(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32)).max())


@pytest.mark.parametrize("gates", [False, True])
def test_pooled_kernel_lowers_to_triton_without_a_gpu(gates):
    """Lowering for CUDA runs the Pallas Triton lowering on CPU: a primitive Triton cannot express fails
    here, in CI, instead of on the device. gates: g and beta formed from a projection's b and a columns."""
    q, k, v, g, beta, _ = random_inputs(B=1, T=3, Hk=2, Hv=4, dk=128, dv=128)
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    pool, slots = jnp.zeros((3, 2, 4, 128, 128)), jnp.array([2])
    flag = jnp.array([True])
    source = GateSource(jnp.ones((1, 3, 16), jnp.bfloat16), 8, jnp.ones(4), jnp.ones(4), jnp.array([2])) if gates else None
    fn = lambda q, k, v, g, b: gdn_recurrent_pooled(  # noqa: E731
        pack_qkv(q, k, v), None if gates else g, None if gates else b, pool, slots, slots - 1, flag, flag,
        interpret=False, gates=source)
    text = jax.jit(fn).trace(bf(q), bf(k), bf(v), g, beta).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


def test_pooled_kernel_refuses_gates_it_cannot_read():
    """GateSource with g and beta also given, or with b and a columns past the product's end: a clear error."""
    q, k, v, g, beta, _ = random_inputs(B=1, T=2, Hk=2, Hv=4, dk=16, dv=16)
    pool, slots, flag = jnp.zeros((2, 2, 4, 16, 16)), jnp.array([1]), jnp.array([False])
    source = jnp.ones((1, 2, 12))
    args = (pool, slots, slots - 1, flag, flag)
    with pytest.raises(ValueError, match="g = beta = None"):
        gdn_recurrent_pooled(pack_qkv(q, k, v), g, beta, *args, gates=GateSource(source, 4, jnp.ones(4), jnp.ones(4)))
    with pytest.raises(ValueError, match="b and a columns"):  # the a columns would run past the source
        gdn_recurrent_pooled(pack_qkv(q, k, v), None, None, *args, gates=GateSource(source, 6, jnp.ones(4), jnp.ones(4)))


def gates_in_product(g, beta, T, rng):
    """A GateSource over a product y [B, T, 5 + 2 * Hv] with b and a at columns 3 .. 3 + 2 * Hv, with A_log,
    dt_bias and num_valid [B] (row 1 padded after its first token), and the (g, beta) that
    `jaxgdn.model.gdn.gdn_projections` forms from them (zero past num_valid). g, beta give the shape."""
    from jaxgdn.model.gdn import gdn_gates
    from jaxgdn.model.params import GDNParams

    B, _, Hv = g.shape
    y = jnp.asarray(rng.standard_normal((B, T, 5 + 2 * Hv)), jnp.float32)
    A_log, dt_bias = (jnp.asarray(rng.standard_normal(Hv), jnp.float32) for _ in range(2))
    num_valid = jnp.asarray([T, 1] + [T] * (B - 2))
    p = GDNParams(**{f: None for f in GDNParams.__dataclass_fields__} | {"A_log": A_log, "dt_bias": dt_bias})
    g, beta = gdn_gates(p, y[..., 3 + Hv : 3 + 2 * Hv], y[..., 3 : 3 + Hv])  # gdn_gates(p, a, b)
    valid = (jnp.arange(T)[None, :] < num_valid[:, None])[..., None]
    gates = GateSource(y, 3, A_log, dt_bias, num_valid)
    return gates, jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)


def check_pooled_kernel(T, B=4, Hk=2, Hv=4, dk=16, dv=32, W=3, tol=1e-5, from_product=False, **options):
    """Rows read pool[slot, start] (zeros when fresh); verify rows write the state after each window
    position to checkpoints 0..min(T, W)-1, other rows write their final state to checkpoint 0; other
    slots and checkpoints are untouched. Rows alternate verify / not, every third is fresh; errors are
    relative to the largest reference value. options: the kernel's program-shape keywords; from_product: the
    kernel forms g and beta from an in_proj product's b and a columns (row 1 padded after one token)."""
    q, k, v, g, beta, _ = random_inputs(B=B, T=T, Hk=Hk, Hv=Hv, dk=dk, dv=dv, seed=5 + T)
    rng = np.random.default_rng(1)
    pool = jnp.asarray(rng.standard_normal((B + 2, W, Hv, dk, dv)), jnp.float32)
    slots = jnp.asarray(rng.permutation(B + 2)[:B])
    start = jnp.asarray(rng.integers(0, W, B))
    fresh, verify = jnp.arange(B) % 3 == 2, jnp.arange(B) % 2 == 0
    if from_product:  # b and a in an in_proj product, the gates formed in the kernel (`gates_in_product`)
        gates, g, beta = gates_in_product(g, beta, T, rng)
        run = jax.jit(lambda qkv, *a: gdn_recurrent_pooled(qkv, None, None, *a, **options, gates=gates))
        o, new = run(pack_qkv(q, k, v), pool, slots, start, fresh, verify)
    else:
        run = jax.jit(lambda *a: gdn_recurrent_pooled(*a, **options))
        o, new = run(pack_qkv(q, k, v), g, beta, pool, slots, start, fresh, verify)
    expect = np.asarray(pool).copy()
    rel = lambda a, b: max_err(a, b) / max(float(jnp.abs(b).max()), 1.0)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        for b in range(B):
            s0 = jnp.zeros_like(pool[0, 0]) if fresh[b] else pool[slots[b], start[b]]
            o_ref, s_ref, states = gdn_recurrent_checkpoints(*(x[b : b + 1] for x in (q, k, v, g, beta)), s0[None])
            assert rel(o[b], o_ref[0]) <= tol, b
            if verify[b]:
                expect[int(slots[b]), : min(T, W)] = np.asarray(states[0, :W])
            else:
                expect[int(slots[b]), 0] = np.asarray(s_ref[0])
    assert rel(new, expect) <= tol


@pytest.mark.parametrize("T, options", [(3, {}), (1, {}), (4, {}),
                                        (3, {"block_v": 16, "evict_first": False, "num_warps": 4}),
                                        (1, {"from_product": True}), (3, {"from_product": True})])
def test_pooled_kernel_reads_the_start_checkpoint_and_writes_in_place(T, options):
    """See check_pooled_kernel. T = 1 (decode) has its own store path; T = 4 runs past the 3 checkpoints
    (a verify row keeps the first 3); the options (a narrower dv tile, no cache hints, 4 warps at T = 3)
    change only how the kernel runs; from_product: the gates formed in the kernel, as the engine's chain does."""
    check_pooled_kernel(T, **options)


def test_engine_with_pool_kernel_equals_plain_greedy():
    """PD + MTP K=2 on the ragged GDN kernels (interpret mode): short rows (decode, verify windows, prompt
    tails, short chunks) on the token loop over the pool, the longer prompt chunks on the chunked form;
    every request equals one-request greedy decoding."""
    from helpers import naive_greedy, small_config

    from jaxgdn.engine.config import EngineConfig
    from jaxgdn.engine.request import SamplingParams
    from jaxgdn.engine.workers import decode_engine, prefill_engine, run_disaggregated
    from jaxgdn.model.params import init_random_params

    cfg = small_config(eos_token_ids=(), linear_value_head_dim=32)
    params = init_random_params(cfg, seed=7)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (1, 2, 5, 9, 23)]
    ecfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, kv_page_size=4,
                        dtype="float32", num_speculative_tokens=2, pd=True, gdn_impl="pallas")
    P = prefill_engine(params, cfg, ecfg, garbage_seed=1)
    D = decode_engine(params, cfg, ecfg, garbage_seed=2)  # garbage in the slots: fresh rows must ignore it
    sp = SamplingParams(temperature=0, max_tokens=5)
    rids = run_disaggregated(P, D, prompts, [sp] * len(prompts))
    for r, p in zip(rids, prompts):
        assert D.output(r).token_ids == naive_greedy(params, cfg, p, 5)


@gpu_test
@pytest.mark.parametrize("T, B, from_product", [(1, 64, False), (2, 32, False), (4, 8, False), (1, 64, True),
                                                (3, 32, True)])
def test_gdn_pool_kernel_compiled_at_the_0_8b_widths_equals_reference(T, B, from_product):
    """The in-place pool kernel as the engine runs it (dv tiles of `value_block`, `pool_warps(T)` warps,
    evict-first hints; decode rows on the one-store path, verify windows on masked per-position stores; the
    gates given or formed from the projection) against the fp32 reference: reads the start checkpoint, writes
    checkpoints in place, leaves the rest."""
    check_pooled_kernel(T, B=B, Hk=16, Hv=16, dk=128, dv=128, W=4, tol=1e-4, from_product=from_product)
