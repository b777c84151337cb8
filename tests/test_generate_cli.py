"""The generate CLI: clear messages for missing checkpoints and prompts; greedy output equals the model's."""

import pytest
from helpers import naive_greedy, small_config

from jaxgdn import generate
from jaxgdn.model.checkpoint import save_checkpoint
from jaxgdn.model.params import init_random_params


@pytest.mark.parametrize("flags", [["--pd", "--num-speculative-tokens", "2"],
                                   ["--async-scheduling", "off", "--no-fold-norms"]])
def test_cli_generates_greedy_tokens(tmp_path, capsys, monkeypatch, flags):
    from jaxgdn import llm

    folds = []  # the fold argument of every serving layout the CLI's LLM built
    layout = llm.serving_layout
    monkeypatch.setattr(llm, "serving_layout", lambda params, fold: folds.append(fold) or layout(params, fold))
    cfg = small_config(eos_token_ids=())
    params = init_random_params(cfg, seed=2)
    save_checkpoint(tmp_path / "ck", cfg, params)
    rc = generate.main(["--model", str(tmp_path / "ck"), "--prompt-ids", "5,6,7", "--max-tokens", "4",
                        "--max-model-len", "64", "--kv-page-size", "8", "--max-num-batched-tokens", "32", *flags])
    assert rc == 0
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if ln.startswith("ids [")][0]
    got = [int(x) for x in line[len("ids ["):-1].split(",")]
    assert got == naive_greedy(params, cfg, [5, 6, 7], 4)
    assert folds == [("--no-fold-norms" not in flags)]
    if "--pd" in flags:
        assert "MTP K=2" in out and "PD:" in out


def test_cli_rejects_async_scheduling_with_pd(tmp_path, capsys):
    cfg = small_config(eos_token_ids=())
    save_checkpoint(tmp_path / "ck", cfg, init_random_params(cfg, seed=2))
    rc = generate.main(["--model", str(tmp_path / "ck"), "--prompt-ids", "5,6", "--async-scheduling", "on",
                        "--num-speculative-tokens", "1", "--pd"])
    assert rc == 2 and "async_scheduling needs" in capsys.readouterr().err


def test_cli_errors_are_clear(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(generate, "CHECKPOINTS_DIR", tmp_path)
    assert generate.main([]) == 2
    assert "no default checkpoint" in capsys.readouterr().err
    assert generate.main(["--model", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
    assert generate.main(["--model", str(tmp_path / "missing")]) == 2
    assert "give --prompt" in capsys.readouterr().err
