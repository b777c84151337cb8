"""Tensor parallelism: the same tokens at every mesh size, in one process on virtual CPU devices and across two
processes (jax.distributed); clear errors for sizes that do not divide the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import small_config
from servers import free_port
from tp_child import tp_config

from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.llm_engine import LLMEngine
from jaxgdn.engine.tensor_parallel import local_config, shard_major_order
from jaxgdn.model.checkpoint import save_checkpoint
from jaxgdn.model.params import init_random_params

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def child_tokens(settings: list[dict]) -> list:
    """tp_child.py's tokens for each setting (its own process: the virtual device count is set at JAX's start)."""
    run = subprocess.run([sys.executable, str(HERE / "tp_child.py"), json.dumps(settings)], capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def assert_same_as_tp1(settings: list[dict], results: list) -> None:
    key = lambda s: (s["K"], s["pd"], s.get("kernels", False), s.get("prefix", False))  # noqa: E731
    base = {key(s): r for s, r in zip(settings, results) if s["tp"] == 1}
    for s, r in zip(settings, results):
        assert r == base[key(s)], f"tokens at {s} differ from tensor_parallel_size 1"
    assert all(len(out) == 10 for r in results for out in r)


def test_sharded_head_is_exact_and_each_block_all_reduces_once():
    """The LM head split over 4 devices with a padded vocabulary: argmax and gathered logits equal one device's.
    A TP=2 decode step all-reduces once per mixer, once per MLP and once per embedding (2L + 1; an MTP draft
    adds its embedding and its layer's two), each [rows, H] in fp32 (`bench comm` reads the same counts)."""
    run = subprocess.run([sys.executable, str(HERE / "tp_child.py"), "head"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["max_logit_row0"] < 0 and got["want_argmax"][1] == 3
    assert got["argmax"] == got["want_argmax"]
    assert got["logits_shape"] == [6, 250] and got["logits_close"]
    c = got["collectives"]
    L, row_bytes = c["layers"], 2 * c["hidden"] * 4  # 2 rows of H fp32
    assert c["counts"]["0"]["all_reduce"] == [2 * L + 1, (2 * L + 1) * row_bytes]
    assert c["counts"]["1"]["all_reduce"][0] == 2 * L + 1 + 3


def grid(tps, K, pd, **extra):
    return [{"tp": tp, "K": K, "pd": pd, **extra} for tp in tps]


def test_tp_tokens_equal_single_device():
    """Greedy and seeded tokens at TP 2 and 4 equal TP 1's: plain steps at TP 4 (the vocabulary padded); PD + MTP
    (K=2) with handoffs as bytes, whose conv windows change channel order between the mesh and the wire, at TP 2
    with the prefill worker on devices 0-1 and the decode worker on 2-3; prefix-cache hits at TP 2 (snapshots
    split as the slots). (-m slow: the other combinations, and the Pallas kernels, interpreted, run per shard.)"""
    settings = grid((1, 4), 0, False) + grid((1,), 2, True, bytes=True) + [
        {"tp": 2, "K": 2, "pd": True, "bytes": True, "decode_from": 2}] + grid((1, 2), 0, False, prefix=True)
    assert_same_as_tp1(settings, child_tokens(settings))


def test_tp2_pd_copies_handoffs_in_place_and_compiles_nothing_after_start_up():
    """A precompiled PD + MTP pair on one TP=2 mesh (handoffs copied from the prefill worker's sharded pools into the
    decode worker's): TP 1's tokens, and no JAX compile event while serving."""
    run = subprocess.run([sys.executable, str(HERE / "tp_child.py"), "pd-compiles"], capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["tokens"][0] == got["tokens"][1] and all(len(out) == 10 for out in got["tokens"][1])
    assert got["compiles"] == [0]


@pytest.mark.slow
def test_tp_tokens_mtp_alone_pd_alone_and_kernels():
    settings = (grid((1, 2, 4), 2, False) + grid((1, 2, 4), 0, True) + grid((1, 2), 0, False)
                + grid((1, 4), 2, True, bytes=True) + grid((1, 2), 2, False, kernels=True))
    assert_same_as_tp1(settings, child_tokens(settings))


def test_multi_host_generate(tmp_path):
    """`generate` over two processes (jax.distributed, JAX's CPU collectives), one TP=4 mesh of their 2 + 2
    devices, prints the tokens of a one-device run."""
    cfg = tp_config()
    save_checkpoint(tmp_path / "ck", cfg.replace(eos_token_ids=()), init_random_params(cfg, seed=3))
    flags = [sys.executable, "-m", "jaxgdn.generate", "--model", str(tmp_path / "ck"), "--prompt-ids", "5,6,7,8",
             "--prompt-ids", ",".join(map(str, range(10, 40))), "--max-tokens", "8", "--num-speculative-tokens", "2",
             "--max-model-len", "96", "--max-num-batched-tokens", "32", "--max-num-seqs", "4", "--no-precompile"]
    env = {**os.environ, "JAXGDN_CACHE_DIR": "", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}

    def ids(stdout: str) -> list[str]:
        return [line for line in stdout.splitlines() if line.startswith("ids [")]

    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(flags + ["-tp", "4", "--coordinator-address", address, "--num-processes", "2",
                                       "--process-id", str(i)], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    single = subprocess.run(flags, cwd=ROOT, env=env, text=True, capture_output=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    assert len(ids(single.stdout)) == 2
    assert ids(outs[0][0]) == ids(single.stdout)
    assert ids(outs[1][0]) == []  # process 1 serves, process 0 prints


def test_tp_sizes_that_do_not_divide_are_clear_errors():
    cfg = small_config()  # 2 KV heads, 2 GDN key heads
    with pytest.raises(ValueError, match="tensor_parallel_size 4 .* num_key_value_heads 2, linear_num_key_heads 2"):
        local_config(cfg, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 devices, 1 available"):
        LLMEngine(init_random_params(cfg, seed=0), cfg, EngineConfig(tensor_parallel_size=2, max_num_seqs=2,
                                                                        max_model_len=32, compilation_cache=False))


def test_shard_major_order():
    """Segments q (4 rows) and k (2 rows) over 2 shards: shard 0 holds q[0:2] ‖ k[0:1], shard 1 q[2:4] ‖ k[1:2]."""
    assert shard_major_order((4, 2), 2).tolist() == [0, 1, 4, 2, 3, 5]
    order = shard_major_order((6, 6, 3), 3)
    assert sorted(order.tolist()) == list(range(15)) and not np.array_equal(order, np.arange(15))


def test_single_device_step_has_no_collectives():
    """tensor_parallel_size 1 (the default) runs the plain step: no shard_map, no all-reduce or all-gather (the
    check can fail: a TP=2 engine's program has them, test_tp_tokens_equal_single_device)."""
    cfg = small_config()
    engine = LLMEngine(init_random_params(cfg, seed=0), cfg, EngineConfig(
        max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, num_speculative_tokens=1, compilation_cache=False))
    for key in engine.program_keys():
        text = engine.runner.lower(*key).as_text()
        assert "all_reduce" not in text and "all_gather" not in text and "shard_map" not in text
