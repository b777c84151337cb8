"""The README's quickstart runs as written and prints what its comments say."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quickstart_code() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_quickstart_runs_as_written(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the quickstart names the shipped checkpoint relative to the checkout
    exec(compile(quickstart_code(), "README.md quickstart", "exec"), {})
    text, last = capsys.readouterr().out.rstrip().rsplit("\n", 1)
    assert text.rstrip().endswith("#### 12")
    reason, acceptance = last.split()
    assert reason == "stop" and float(acceptance) > 1.0
