"""Run in its own process by test_tensor_parallel.py, on virtual CPU devices: greedy (and seeded) tokens of one
random config served at several tensor-parallel sizes, as JSON on stdout.

argv: a JSON list of settings {"tp", "K", "pd", "bytes", "decode_from", "kernels" (the Pallas kernels, interpreted),
"prefix" (requests that resume from the prefix cache's pages and sharded snapshots)}; the process sets its device
count before JAX starts.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":  # before JAX starts; importing tp_config from here leaves the devices alone
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from helpers import small_config  # noqa: E402

from jaxgdn.engine.compile_times import CompileEvents  # noqa: E402
from jaxgdn.engine.config import EngineConfig  # noqa: E402
from jaxgdn.engine.llm_engine import LLMEngine  # noqa: E402
from jaxgdn.engine.request import SamplingParams  # noqa: E402
from jaxgdn.engine.tensor_parallel import make_mesh  # noqa: E402
from jaxgdn.engine.workers import decode_engine, prefill_engine, run_disaggregated  # noqa: E402
from jaxgdn.model.params import init_random_params  # noqa: E402


def tp_config():
    """A small config whose head counts and MLP width 4 divides (Hv = 2 Hk, Hq = 2 Hkv), and a vocabulary it does not
    (the shards pad it)."""
    return small_config(num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4,
                        linear_num_value_heads=8, linear_value_head_dim=32, intermediate_size=128, vocab_size=250,
                        tie_word_embeddings=True)


def workload(prefix: bool = False):
    """Mixed prompt lengths (one spans two chunks); every third request sampled with a seed. prefix: two more that
    share the 40-token prompt's first 33 and 40 tokens."""
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(2, 250, n)] for n in (5, 17, 40, 3, 9, 1)]
    if prefix:
        prompts += [prompts[2][:33] + [7, 8], prompts[2] + [9]]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8 if i % 3 == 2 else 0.0, seed=i)
              for i in range(len(prompts))]
    return prompts, params


def serve(setting: dict) -> list[list[int]]:
    cfg = tp_config()
    weights = init_random_params(cfg, seed=1)
    ecfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, dtype="float32",
                        tensor_parallel_size=setting["tp"], num_speculative_tokens=setting["K"], pd=setting["pd"],
                        compilation_cache=False, **({"gdn_impl": "pallas", "attention_impl": "pallas"}
                                                    if setting.get("kernels") else {}),
                        **({"kv_page_size": 4, "prefix_cache_state_interval": 8} if setting.get("prefix") else {}))
    prompts, params = workload(setting.get("prefix", False))
    if not setting["pd"]:
        engine = LLMEngine(weights, cfg, ecfg)
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_unfinished:
            engine.step()
    else:
        # "decode_from": the decode worker's mesh starts at that device (its own devices), else both share one
        start = setting.get("decode_from", 0)
        decode_at = {"mesh": make_mesh(jax.devices()[start:], setting["tp"])} if setting["tp"] > 1 else {}
        prefill = prefill_engine(weights, cfg, ecfg, memory_share=0.5 if not start else 1.0)
        engine = decode_engine(weights, cfg, ecfg, **decode_at)
        if setting.get("precompile"):  # as LLM(...) starts a PD pair: handoffs copied in place on one mesh
            engine.role.connect(prefill, "bytes" if setting.get("bytes") else "object")
            prefill.precompile(sampled=False)
            engine.precompile()
            events = CompileEvents().start()
        ids = run_disaggregated(prefill, engine, prompts, params, transport_bytes=setting.get("bytes", False))
        if setting.get("precompile"):
            events.stop()
            COMPILES.append(events.count)
    return [list(engine.requests[i].output_token_ids) for i in ids]


def head_checks() -> dict:
    """The sharded LM head against the one-device one on 4 devices, vocabulary 250 (2 padding rows): a row whose
    logits are all negative (the padding's zero logits must not win), a row whose maximum is tied by tokens
    on three shards (the first index wins), random rows, and the gathered logits."""
    from functools import partial

    from jax.sharding import PartitionSpec as P

    from jaxgdn.engine.tensor_parallel import TP, shard_major
    from jaxgdn.model.parallel import head_argmax, head_logits
    from jaxgdn.model.params import serving_layout
    from jaxgdn.model.policy import KernelPolicy

    cfg = tp_config()
    rng = np.random.default_rng(0)
    table = rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
    table[:, 0] = np.abs(table[:, 0]) + 1.0
    table /= np.linalg.norm(table, axis=1, keepdims=True)
    table[100] = table[200] = table[3]
    hidden = rng.standard_normal((6, cfg.hidden_size)).astype(np.float32)
    hidden[0] = 0.0
    hidden[0, 0] = -100.0  # every token's logit below -1
    hidden[1] = 10.0 * table[3]  # tokens 3, 100 and 200 share the maximum
    params = serving_layout(init_random_params(cfg, seed=4)).replace(embed_tokens=table)
    sharded = shard_major(params, cfg, 4)
    policy = KernelPolicy(tp_axis=TP)

    @partial(jax.shard_map, mesh=make_mesh(jax.devices(), 4), in_specs=(P(TP, None), P()), out_specs=(P(), P()),
             check_vma=False)
    def sharded_head(table, hidden):
        p = sharded.replace(embed_tokens=table)
        return head_argmax(p, hidden, cfg.vocab_size, policy), head_logits(p, hidden, cfg.vocab_size, policy)

    got_argmax, got_logits = sharded_head(np.asarray(sharded.embed_tokens), hidden)
    full = hidden @ table.T
    return {"argmax": np.asarray(got_argmax).tolist(), "want_argmax": full.argmax(-1).tolist(),
            "max_logit_row0": float(full[0].max()), "logits_shape": list(np.asarray(got_logits).shape),
            "logits_close": bool(np.allclose(np.asarray(got_logits), full, atol=1e-5))}


def collective_counts() -> dict:
    """All-reduces in the lowered TP=2 decode program (uniform, 2 rows) of the test config, with and without an
    MTP draft, counted by `bench comm`'s reader."""
    from jaxgdn.bench.comm import count_collectives
    from jaxgdn.engine.programs import ProgramSet
    from jaxgdn.engine.step_layout import empty_step, pack_step_arrays

    cfg = tp_config()
    counts = {}
    for K in (0, 1):
        ecfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, dtype="float32",
                            tensor_parallel_size=2, num_speculative_tokens=K, compilation_cache=False)
        engine = LLMEngine(init_random_params(cfg, seed=0), cfg, ecfg)
        shape = ProgramSet(ecfg).launch(2, 1)
        _, layout = pack_step_arrays(empty_step(shape, ecfg, engine.block_q))
        module = engine.runner.lower(layout, False, 1, shape.width).compiler_ir("stablehlo")
        counts[K] = {k: list(v) for k, v in count_collectives(module).items()}
    return {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "counts": counts}


COMPILES: list[int] = []  # JAX compile events while serving, of each precompiled PD setting


if __name__ == "__main__":
    if sys.argv[1] == "head":
        print(json.dumps({**head_checks(), "collectives": collective_counts()}))
    elif sys.argv[1] == "pd-compiles":  # precompiled PD pairs on one mesh: tokens, and compiles while serving
        settings = [{"tp": 1, "K": 2, "pd": True}, {"tp": 2, "K": 2, "pd": True, "precompile": True}]
        print(json.dumps({"tokens": [serve(s) for s in settings], "compiles": COMPILES}))
    else:
        print(json.dumps([serve(s) for s in json.loads(sys.argv[1])]))
