"""The program cache on disk (GPU only): a start-up whose step programs were stored loads them without
tracing, lowering or compiling, and serves the same tokens; a damaged entry is recompiled; keys separate what
decides a program; a stored program round-trips."""

import jax
import jax.numpy as jnp
import pytest
from helpers import small_config

from jaxgdn.engine import program_cache, runner
from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.request import SamplingParams
from jaxgdn.llm import LLM
from jaxgdn.model.checkpoint import save_checkpoint
from jaxgdn.model.params import init_random_params

CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, dtype="float32",
                      num_speculative_tokens=1)
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11]]


def start_and_generate(path) -> tuple[dict, list, list]:
    """A start-up as in a new process (no program compiled in this one): its phases, greedy tokens and the
    cache files of its programs."""
    runner.clear_compiled_programs()
    with LLM(str(path), CONFIG) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        assert llm.compiles_after_startup == 0
        r = llm.engine.runner
        files = [runner.program_cache().path(r._shared_key(key)) for key in r.program_keys]
        return llm.startup, [o.token_ids for o in outs], files


@pytest.mark.gpu
def test_second_startup_loads_every_program_and_serves_the_same_tokens(tmp_path):
    cfg = small_config()
    path = save_checkpoint(tmp_path / "ck", cfg, init_random_params(cfg, seed=1))
    _, want, files = start_and_generate(path)
    assert all(f.exists() for f in files)
    second, tokens, _ = start_and_generate(path)
    assert tokens == want
    work = second["precompile"]
    assert work["program_hits"] == second["programs"] > 0 and work["program_misses"] == 0
    assert work["trace_s"] == work["lower_s"] == work["compile_s"] == 0  # nothing traced: loaded only


@pytest.mark.gpu
def test_damaged_entry_is_recompiled(tmp_path, caplog):
    cfg = small_config(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    path = save_checkpoint(tmp_path / "ck", cfg, init_random_params(cfg, seed=2))
    _, want, files = start_and_generate(path)
    for f in files:
        f.write_bytes(b"not a program")
    startup, tokens, _ = start_and_generate(path)
    assert tokens == want
    assert "dropping unreadable" in caplog.text
    assert startup["precompile"]["program_misses"] == len(files)
    assert all(f.read_bytes() != b"not a program" for f in files)  # stored again


def test_stored_program_round_trips(tmp_path):
    cache = program_cache.ProgramCache(tmp_path)
    compiled = jax.jit(lambda x, y: x * 2 + y, donate_argnums=1).lower(jnp.ones(8), jnp.ones(8)).compile()
    cache.store(("double",), compiled)
    loaded = cache.load(("double",))
    assert loaded is not None and cache.load(("triple",)) is None
    assert (loaded(jnp.arange(8.0), jnp.ones(8)) == jnp.arange(8.0) * 2 + 1).all()


def test_off_a_gpu_only_jax_cache_serves():
    if jax.devices()[0].platform == "gpu":
        pytest.skip("on a GPU the program cache serves")
    assert runner.program_cache() is None


def test_key_covers_the_source_and_the_launch(tmp_path, monkeypatch):
    cache = program_cache.ProgramCache(tmp_path)
    key = ("settings", ("layout",), True, 1, 0)
    assert cache.path(key) == cache.path(tuple(key))
    assert cache.path(key) != cache.path(("settings", ("layout",), False, 1, 0))
    before = cache.path(key)
    with monkeypatch.context() as m:
        m.setattr(program_cache, "source_digest", lambda: "edited source")
        assert cache.path(key) != before
    assert cache.path(key) == before
    assert program_cache.ProgramCache(tmp_path, xla_flags="--xla_some_flag=1").path(key) != before
    assert jax.devices()[0].platform in repr(cache.environment)
