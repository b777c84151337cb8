"""The generate CLI: clear message without a checkpoint; greedy continuation equals argmax of the model."""

import numpy as np

from helpers import small_config
from jaxgdn import generate
from jaxgdn.checkpoint import save_checkpoint
from jaxgdn.model import forward
from jaxgdn.params import init_random_params


def test_cli_generates_greedy_tokens(tmp_path, capsys):
    cfg = small_config(eos_token_ids=())
    params = init_random_params(cfg, seed=2)
    save_checkpoint(tmp_path / "ck", cfg, params)
    rc = generate.main(["--model", str(tmp_path / "ck"), "--prompt-ids", "5,6,7", "--max-tokens", "4"])
    assert rc == 0
    line = capsys.readouterr().out.strip()
    got = [int(x) for x in line.split("->")[1].split("]")[0].strip(" [").split(",")]
    # Reference: greedy by full recompute.
    ids = [5, 6, 7]
    for _ in range(4):
        ids.append(int(np.asarray(forward(params, cfg, np.asarray([ids]))[0])[0, -1].argmax()))
    assert got == ids[3:]


def test_cli_errors_are_clear(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(generate, "CHECKPOINTS_DIR", tmp_path)
    assert generate.main([]) == 2
    assert "no default checkpoint" in capsys.readouterr().err
    assert generate.main(["--model", str(tmp_path / "missing")]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
