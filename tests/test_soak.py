"""`python -m jaxgdn.bench soak` as a user runs it: real server processes under the mixed HTTP traffic (streams,
hang-ups, n=2, seeds, logprobs, JSON schemas, stop strings, shared prefixes, chat). After a minute of it the PD
pair with MTP has failed nothing the client did not abort, its requests hold no page or slot, the prefix cache gives
every page and snapshot back on reset, and the greedy probes give the tokens they gave at the start. The 30-minute
soaks the README cites are the slow tests."""

import json
import subprocess
import sys

import pytest
from servers import ROOT

SMALL = "--max-num-seqs 16 --max-num-batched-tokens 256 --num-kv-pages 600 --dtype float32 --no-precompile"


def soak(tmp_path, *args: str, timeout: float) -> dict:
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, "-m", "jaxgdn.bench", "soak", "--out", str(out), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert run.returncode == (0 if payload["passed"] else 1)
    return payload


def assert_clean(p: dict) -> None:
    v = p["verdict"]
    assert v["no_unexpected_errors"], p["first_errors"]
    assert v["requests_hold_nothing_at_the_end"], p["end_state"]
    assert v["reset_returns_everything"], p["after_reset"]
    assert v["probes_identical"], p["probes"]
    assert p["passed"] and p["requests"]["ok"] >= 10


def test_a_minute_of_mixed_traffic_on_the_pd_pair_with_mtp_leaks_nothing(tmp_path):
    # a fixed rate: on servers that compile on first use, a short capacity probe measures the compiler
    p = soak(tmp_path, "--pd", "--minutes", "1", "--rate", "1", "--sample-interval", "2",
             "--server-args", SMALL + " --num-speculative-tokens 1", timeout=900)
    assert_clean(p)
    assert p["rss"]["growth"] is None  # too short to judge memory growth
    assert p["end_state"]["held_by_prefix_cache"]["prefill"]["kv_pages_cached"] > 0  # what the reset gave back
    assert {"stream", "chat", "prefix", "seeded"} <= set(p["features"])
    assert (tmp_path / "soak.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("pd", [[], ["--pd", "--server-args", "--max-num-seqs 32 --max-num-batched-tokens 512 "
                                                             "--num-kv-pages 1200 --num-speculative-tokens 1"]],
                         ids=["colocated", "pd-mtp"])
def test_thirty_minutes_of_mixed_traffic(tmp_path, pd):
    p = soak(tmp_path, "--minutes", "30", *pd, timeout=3 * 3600)
    assert_clean(p)
    assert p["verdict"]["rss_growth_within_5pct"], p["rss"]
