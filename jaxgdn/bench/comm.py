"""`bench comm`: the collectives of one tensor-parallel decode step, read from the step program itself.

The step is lowered (not run) on a mesh of N devices with abstract weights and pools, so the largest presets
need no memory: run it on CPU with XLA_FLAGS=--xla_force_host_platform_device_count=N. The StableHLO's
all-reduces and all-gathers are counted through the calls (a layer kind's function is called once per layer),
with their payload bytes; the same program runs on a GPU with Pallas kernels in place of the XLA forms, and the
kernels hold no collective.
"""

from __future__ import annotations

import numpy as np

COLLECTIVES = ("stablehlo.all_reduce", "stablehlo.all_gather")


def _tensor_bytes(t) -> int:
    """Bytes of a ranked tensor type, e.g. tensor<1x4096xbf16>."""
    from jax._src.lib.mlir import ir

    t = ir.RankedTensorType(t)
    digits = "".join(ch for ch in str(t.element_type) if ch.isdigit())  # bf16, f32, i32, i1
    return int(np.prod(t.shape, dtype=np.int64)) * max(int(digits or 8), 8) // 8


def count_collectives(module) -> dict:
    """{op name: (count, payload bytes)} of a lowered module's main function, following func.call."""
    funcs = {op.attributes["sym_name"].value: op for op in module.body.operations if op.operation.name == "func.func"}
    memo: dict[str, dict] = {}

    def add(total, part):
        for k, (n, b) in part.items():
            n0, b0 = total.get(k, (0, 0))
            total[k] = (n0 + n, b0 + b)

    def walk(op, total):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    name = inner.operation.name
                    if name in COLLECTIVES:
                        add(total, {name.split(".")[1]: (1, sum(_tensor_bytes(r.type) for r in inner.results))})
                    elif name == "func.call":
                        add(total, visit(inner.attributes["callee"].value))
                    walk(inner, total)

    def visit(name: str) -> dict:
        if name not in memo:
            memo[name] = {}
            walk(funcs[name], memo[name])
        return memo[name]

    return visit("main")


def step_collectives(model: str, tp: int, batch: int, K: int, stochastic: bool) -> dict:
    """The collectives of a decode step of `batch` rows (each 1+K tokens) of the preset at tensor_parallel_size tp."""
    import jax
    import jax.numpy as jnp

    from ..engine.config import EngineConfig
    from ..engine.placement import Placement
    from ..engine.programs import ProgramSet
    from ..engine.runner import ModelRunner
    from ..engine.state import init_engine_state
    from ..engine.step_layout import empty_step, pack_step_arrays
    from ..engine.tensor_parallel import local_config, make_mesh, param_specs, shardings
    from ..model.config import PRESETS
    from ..model.params import init_random_params, serving_layout
    from pallas_kernels.ragged_attention import block_queries

    cfg = PRESETS[model]()
    ecfg = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(16, batch * (1 + K)), max_model_len=256,
                        num_kv_pages=batch * 16 + 1, num_speculative_tokens=K, tensor_parallel_size=tp,
                        compilation_cache=False, precompile=False)
    mesh = make_mesh(jax.devices(), tp)
    params = jax.eval_shape(lambda: serving_layout(init_random_params(cfg, dtype=jnp.bfloat16, on_device=True)))
    pad = lambda x: None if x is None else jax.ShapeDtypeStruct((-(-x.shape[0] // tp) * tp, x.shape[1]), x.dtype)  # noqa: E731
    params = params.replace(embed_tokens=pad(params.embed_tokens), lm_head=pad(params.lm_head))
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                          shardings(mesh, param_specs(params)))
    state = Placement(mesh=mesh).abstract_state(
        lambda: init_engine_state(cfg, ecfg, ecfg.num_kv_pages, num_speculative_tokens=K, with_mtp=K > 0))
    runner = ModelRunner(params, cfg, state, policy=ecfg.kernel_policy("cpu"), mesh=mesh)
    local = local_config(cfg, tp)
    # the uniform program of one step of `batch` decode rows (verify windows with K > 0), as GPU decode runs
    shape = ProgramSet(ecfg).launch(batch, 1)
    _, layout = pack_step_arrays(empty_step(shape, ecfg,
                                            block_queries(local.num_attention_heads, local.num_key_value_heads)))
    counts = count_collectives(runner.lower(layout, stochastic, 1, shape.width).compiler_ir("stablehlo"))
    return {"model": model, "tp": tp, "batch": batch, "num_speculative_tokens": K, "sampled": stochastic,
            "program_tokens": shape.tokens,
            **{f"{k}_count": n for k, (n, _) in counts.items()}, **{f"{k}_bytes": b for k, (_, b) in counts.items()},
            "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size}


def bench_comm(args) -> dict:
    rows = []
    for model in args.model:
        for tp in args.tp:
            for batch in args.batch:
                for sampled in (False, True):
                    r = step_collectives(model, tp, batch, args.num_speculative_tokens, sampled)
                    rows.append(r)
                    print(f"{model} tp {tp} batch {batch} {'sampled' if sampled else 'greedy '}: "
                          f"all-reduce {r.get('all_reduce_count', 0)} x = {r.get('all_reduce_bytes', 0) / 1e6:.3f} MB, "
                          f"all-gather {r.get('all_gather_count', 0)} x = {r.get('all_gather_bytes', 0) / 1e6:.3f} MB "
                          f"({r['program_tokens']} tokens a step)", flush=True)
    return {"benchmark": "comm", "rows": rows,
            "note": "collectives of one decode step (the uniform program of batch rows of 1+K tokens), counted in the "
                    "lowered StableHLO through its calls; bytes are each op's result per device (an all-reduce's "
                    "payload, an all-gather's gathered output)"}
