"""`python -m jaxgdn.bench` sub-commands run end to end on CPU at tiny sizes and write complete JSON."""

import json

import pytest

from jaxgdn.bench.__main__ import main
from jaxgdn.bench.spec_pd import expected_tokens_per_step
from jaxgdn.bench.tables import TABLES, benchmark_of, result_files

TINY = "checkpoints/qwen35-tiny-arith"


def run(tmp_path, *argv):
    out = tmp_path / "r.json"
    assert main([*argv, "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["complete"] and d["env"]["backend"] == "cpu" and d["env"]["jax"]
    return d


def test_kernels_bench_checks_ours_against_the_reference(tmp_path):
    d = run(tmp_path, "kernels", "--heads", "2", "--head-dim", "16", "--prefill-shapes", "1x70", "--decode-shapes", "2x1", "2x3",
            "--bandwidth-bytes", "1000000")
    assert [r["kind"] for r in d["rows"]] == ["prefill", "decode", "verify"]
    for r in d["rows"]:
        assert r["ours_ms"] > 0 and r["ours_vs_xla_rel_err"] < 1e-2  # bf16 operands vs the fp32 XLA forms
        assert r["ours_device_us"] > 0  # the profiled call's busy time (host events on a CPU)
        assert "fla_device_us" not in r  # no fla on a CPU: no peer figure made up
    from jaxgdn.bench.tables import floor_bytes_ratio, kernels_table

    assert "ours kernels µs" in kernels_table(d)[0]
    # the verify window's checkpoints (T=3 fp32 states per row and head) and prefill's fp32 o (fla's is bf16) part
    # our byte floor from fla's: bytes of q/k/v (bf16), g/beta, o and the state in and out, plus B*T*H*d*d*4
    prefill, decode, verify = (floor_bytes_ratio(r) for r in d["rows"])
    assert decode == 1.0 and verify == pytest.approx(1 + 3 * 2 * 2 * 16 * 16 * 4 / (
        2 * 3 * 2 * (16 * 2 * 3 + 8 + 16 * 4) + 2 * 2 * 2 * 16 * 16 * 4))
    state, tokens = 2 * 1 * 2 * 16 * 16 * 4, 70 * 2
    assert prefill == pytest.approx((tokens * (16 * 2 * 3 + 8 + 16 * 4) + state) / (tokens * (16 * 2 * 3 + 8 + 16 * 2)
                                                                                      + state))


@pytest.mark.parametrize("command, extra", [
    ("decode", ["--batch", "1", "2", "--steps", "8", "--bandwidth-bytes", "1000000", "--profile", "PROFILE",
                "--async-scheduling", "on", "--decode-steps-per-launch", "2"]),
    pytest.param("prefill", ["--shapes", "1x16", "2x8", "--matmul-size", "128", "--profile", "PROFILE",
                             "--stream-steps", "3"], marks=pytest.mark.slow),
])
def test_model_benches_on_the_shipped_model(tmp_path, command, extra):
    extra = [str(tmp_path / "profile") if a == "PROFILE" else a for a in extra]
    d = run(tmp_path, command, "--model", TINY, "--no-peer", *extra)
    prof = d["rows"][0]["profile_per_step"]  # the trace of replayed steps is summarised into the row
    assert prof["busy_us"] > 0 and prof["events"] > 0 and prof["top"]
    if command == "decode":
        # per request: the prompt's token, the 4 warm-up launches back when the window opens (the 5th is in
        # flight), the 8 timed steps and 5 traced launches after them, all launches whole (2 steps); no
        # compile in the window
        assert d["rows"][0]["async_scheduling"] and d["rows"][1]["generated"] == 2 * (1 + 2 * (4 + 4 + 5))
        assert [r["window_reopened_after_compile"] for r in d["rows"]] == [0, 0]
        # the 4 timed calls bring back the launch in flight when they start (its device time is in the window)
        # and 3 of the 4 they dispatch: the 4th comes back in the first traced call, outside the window
        # (profiled calls run slower). 8 steps, never a masked step.
        assert [r["timed_steps"] for r in d["rows"]] == [8, 8]
        assert {"schedule", "build", "dispatch", "wait"} <= set(d["rows"][0]["host_phase_ms_per_step"])
        assert d["rows"][0]["profile_engine_steps"]["events"] > 0  # real engine steps traced too
        assert d["rows"][0]["device_ms_per_step_fixed_input"] > 0
        # two decode steps per launch: fewer launches than steps, per-step time divides launches
        assert d["rows"][0]["decode_steps_per_launch"] == 2 and d["rows"][0]["launches"] < d["rows"][0]["steps"]
    else:  # the step's wall time split: host phases of the timed steps and the replayed device step
        assert {"schedule", "build", "transfer", "dispatch", "wait"} <= set(d["rows"][0]["host_phase_ms"])
        assert 0 < d["rows"][0]["device_ms"]
        for r in d["rows"]:  # the stream of 3 steps back to back (async scheduling): one launch a step, timed
            assert r["stream_steps"] == 3 and r["stream_ms_per_step"] > 0
            assert r["stream_tokens_per_s"] == pytest.approx(r["batch"] * r["length"] / r["stream_ms_per_step"] * 1e3)
    assert len(d["rows"]) == 2 and d["weight_bytes"] > 0
    for r in d["rows"]:
        assert r["tokens_per_s"] > 0 and r.get("roofline_ms", r.get("flop_floor_ms")) > 0
        assert "transformers_ms" not in r and "transformers_ms_per_step" not in r


def test_spec_bench_measures_real_acceptance(tmp_path):
    d = run(tmp_path, "spec", "--model", "", "--k", "0", "1", "--num-prompts", "2", "--max-tokens", "6")
    no_mtp, mtp = d["rows_shipped"]
    assert no_mtp["mean_acceptance_length"] is None and 1.0 <= mtp["mean_acceptance_length"] <= 2.0
    assert no_mtp["generated"] == mtp["generated"] == 12  # greedy, same tokens either way


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 3) == 1.0
    assert expected_tokens_per_step(1.0, 3) == 4.0
    assert abs(expected_tokens_per_step(0.5, 2) - 1.75) < 1e-12


def test_pd_bench_reports_handoff_bytes(tmp_path):
    d = run(tmp_path, "pd", "--model", TINY, "--lengths", "8", "40")
    small, large = d["rows"]
    assert 0 < small["handoff_bytes"] < large["handoff_bytes"] and large["serialised_bytes"] >= large["handoff_bytes"]


def test_tables_render_every_committed_result(capsys):
    """`bench table` (docs/performance.md) renders each result file the docs cite, and only those are kept."""
    paths = result_files()
    assert paths, "bench/results has result files"
    assert main(["table"]) == 0
    text = capsys.readouterr().out
    for p in paths:
        assert p.name in text
    assert set(TABLES) >= {benchmark_of(json.loads(p.read_text()), p) for p in paths}


def test_profile_calls_summarises_a_traced_function():
    """The probes' timer: a trace of back-to-back calls, summarised per call (host events on a CPU)."""
    import jax
    import jax.numpy as jnp

    from jaxgdn.bench.common import profile_calls

    x = jnp.ones((64, 64))
    one = profile_calls(jax.jit(lambda x: x @ x), x, iters=4)
    assert one["busy_us"] > 0 and one["events"] > 0
    halves = profile_calls(jax.jit(lambda x: x @ x), x, iters=4, divide_by=8)
    assert halves["events"] < one["events"]  # the same kind of trace, per 8 units instead of per 4 calls


def test_serve_bench_runs_a_workload_cold_and_warm_with_no_compile_after_start_up(tmp_path):
    """Two fresh processes (an empty compilation cache, then the filled one), the workload's every request to
    its length at Poisson arrivals, latency percentiles, the bound, and the transformers peer (its continuous
    batching refuses the hybrid cache: recorded, then `generate` timed)."""
    d = run(tmp_path, "serve", "--model", TINY, "--num-prompts", "10", "--input-len", "8", "40", "--output-len", "4",
            "12", "--request-rate", "40", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
            "--max-model-len", "96", "--matmul-size", "128", "--bandwidth-bytes", "1000000")
    cold = d["cold_process"]
    assert cold["compiles_after_startup"] == 0 and cold["programs"] == d["warm_cache_startup"]["programs"] > 4
    from jaxgdn.bench.serve import make_requests

    class Args:
        dataset, num_prompts, input_len, output_len, seed, max_model_len, model = "random", 10, (8, 40), (4, 12), 0, 96, TINY

    want_outputs = sum(o for _, o in make_requests(Args, 256))
    for run_ in (cold["cold"], cold["warm"]):
        assert run_["finished"] == 10 and run_["errors"] == 0 and run_["output_tokens"] == want_outputs
        assert 0 < run_["ttft_ms"]["p50"] <= run_["ttft_ms"]["p99"] and run_["tpot_ms"]["p50"] > 0
    assert cold["bound"]["total_s"] > 0 and cold["warm"]["fraction_of_bound"] > 0
    peer = d["transformers"]
    assert peer.get("wall_s", 0) > 0 or "error" in peer

    # --cache-dir: one process on a given cache (a server's, for an in-process comparison), no second start-up
    cache = tmp_path / "server-cache"
    one = run(tmp_path, "serve", "--model", TINY, "--num-prompts", "10", "--input-len", "8", "40", "--output-len", "4",
              "12", "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "96", "--no-peer",
              "--cache-dir", str(cache), "--matmul-size", "128", "--bandwidth-bytes", "1000000")
    assert "warm_cache_startup" not in one and str(cache) in one["note"] and cache.is_dir()
    assert one["cold_process"]["warm"]["output_tokens"] == want_outputs
    from jaxgdn.bench.tables import serve_table

    assert any(str(cache) in line for line in serve_table(one))
