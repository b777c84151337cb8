"""The arithmetic task, the training entry point, the shipped checkpoint and the accuracy evaluation."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from jaxgdn import eval as jeval
from jaxgdn import generate, task, train
from jaxgdn.model.checkpoint import load_checkpoint
from jaxgdn.model.tokenizer import load_tokenizer

SHIPPED = Path(__file__).resolve().parent.parent / "checkpoints" / "qwen35-tiny-arith"
LINE = re.compile(r", so (\d+)([-+*/])(\d+)=(\d+)\.$|is (\d+)/(\d+)=(\d+)\.$")


def check_solution(p: task.Problem) -> None:
    """Every worked line's arithmetic holds, lines chain, and #### carries the last result."""
    lines = p.solution.split("\n")
    assert lines[-1] == f"#### {p.answer}"
    prev = int(re.search(r"has (\d+) ", p.question).group(1))
    for line in lines[:-1]:
        m = LINE.search(line)
        assert m, line
        if m.group(1):
            a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        else:
            a, op, b, c = int(m.group(5)), "/", int(m.group(6)), int(m.group(7))
        assert a == prev
        assert c == {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op] and (op != "/" or a % b == 0)
        assert 0 <= c <= task.MAX_VALUE
        prev = c
    assert prev == p.answer
    assert 2 <= len(lines) - 1 <= 4


def test_problems_are_deterministic_correct_and_splits_disjoint():
    test = task.take("test", 300)
    assert [p.question for p in test] == [p.question for p in task.take("test", 300)]
    train_q = {p.question for p in task.take("train", 3000)}
    assert not train_q & {p.question for p in test}
    assert all(task.split_of(p.question) == "test" for p in test)
    for p in test[:200]:
        check_solution(p)
    ops = " ".join(p.solution for p in test)
    assert all(sym in ops for sym in "+-*/")  # every operation appears


def test_extract_answer_is_gsm8k_strict_match():
    assert task.extract_answer("so 3+4=7.\n#### 7") == "7"
    assert task.extract_answer("#### 1,234\n#### 5") == "1234"
    assert task.extract_answer("The answer is 7") is None
    assert jeval.is_correct("x\n#### 12", 12) and not jeval.is_correct("#### 13", 12)
    assert not jeval.is_correct(None, 1)


def test_tokenizer_round_trips_and_marks_specials(tmp_path):
    tok = task.build_tokenizer()
    text = task.take("validation", 1)[0].prompt()
    assert tok.decode(tok.encode(text).ids) == text
    assert [tok.token_to_id(t) for t in task.SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.encode("é").ids == [tok.token_to_id(task.UNK)]  # unknown characters map to unk, no crash


def test_load_jsonl_reads_gsm8k_rows_and_names_bad_lines(tmp_path):
    good = tmp_path / "g.jsonl"
    good.write_text(json.dumps({"question": "2+2?", "answer": "2+2=4\n#### 4"}) + "\n\n")
    assert task.load_jsonl(good) == [task.Problem("2+2?", "2+2=4\n#### 4", 4)]
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(ValueError, match=r"b.jsonl:1"):
        task.load_jsonl(bad)
    assert jeval.main(["--data", str(bad), "--model", str(SHIPPED)]) == 2


def test_few_shot_prompt_format():
    p = task.format_prompt("Q2", (("Q1", "A1\n#### 1"),))
    assert p == "Question: Q1\nAnswer: A1\n#### 1\n\nQuestion: Q2\nAnswer:"


def test_train_smoke_writes_a_loadable_checkpoint_and_lowers_the_loss(tmp_path):
    out = tmp_path / "ck"
    rc = train.main(["--out", str(out), "--steps", "12", "--batch", "2", "--hidden", "64", "--layers", "4",
                     "--warmup", "1", "--lr", "3e-3", "--log-every", "1", "--eval-every", "12", "--seed", "3"])
    assert rc == 0
    log = json.loads((out / "train_log.json").read_text())["log"]
    losses = [r["loss"] for r in log]
    assert all(np.isfinite(losses)) and np.mean(losses[-3:]) < losses[0]
    assert "val_trunk_ce" in log[-1]
    cfg, params = load_checkpoint(out)
    assert cfg.has_mtp and params.mtp is not None and cfg.model_type == "qwen3_5_text"
    assert load_tokenizer(out).decode(load_tokenizer(out).encode("#### 12")) == "#### 12"


def test_shipped_checkpoint_layout_and_size():
    files = {f.name for f in SHIPPED.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"} <= files
    assert sum(f.stat().st_size for f in SHIPPED.glob("*.safetensors")) <= 20 * 2**20
    cfg, params = load_checkpoint(SHIPPED)
    assert json.loads((SHIPPED / "config.json").read_text())["model_type"] in ("qwen3_5", "qwen3_5_text")
    assert params.mtp is not None
    assert "full_attention" in cfg.layer_types and "linear_attention" in cfg.layer_types


def test_demo_runs_the_shipped_model_with_pd_and_mtp(capsys):
    assert generate.main(["--demo-problems", "2"]) == 0
    out = capsys.readouterr().out
    assert "PD + MTP K=1" in out and "MTP K=1:" in out and "PD:" in out
    assert out.count("reference answer") == 2


def test_eval_slice_fixed_configs_identical_to_baseline(tmp_path, capsys):
    """The CI slice of the evaluation: every fixed serving configuration gives the baseline's tokens."""
    out = tmp_path / "eval.json"
    rc = jeval.main(["--limit", "8", "--configs", "fixed", "--wide-concurrency", "16", "--quiet",
                     "--dtype", "float32", "--max-model-len", "512", "--max-num-batched-tokens", "256",
                     "--out", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["config"]["name"] for r in rows][:1] == ["baseline"] and len(rows) == 6
    base = rows[0]["accuracy"]
    assert base >= 0.9  # the shipped model solves the task
    for r in rows:
        assert r["identical_to_baseline"] == 1.0 and r["accuracy"] == base and r["num_errors"] == 0
        if r["config"]["num_speculative_tokens"]:
            assert r["acceptance_rate"] >= 0.7
        assert (r["handoff_bytes"] > 0) == r["config"]["pd"]  # PD rows really ran disaggregated
    assert "baseline" in capsys.readouterr().out
