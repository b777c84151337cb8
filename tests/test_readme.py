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


STALE = ("_packed_step", "input_batch.", "jaxgdn.gdn.", "reference §", "reference/", "ragged_forward", "uniform_forward",
         "gdn_pallas", "gdn_chunked_pallas", "gdn_recurrent_pallas", "gdn_ragged_pallas", "conv_pallas",
         "pallas_kernels.gdn import", "pallas_kernels/gdn.py", "pallas_kernels/gdn_ragged.py", "pallas_kernels/gdn_mixer",
         "RECURRENT_MAX_T", "causal_conv_prompt", "OutputGate", "register_gdn_impl", "pooled_kernel_supports",
         "gdn_impl=\"chunked\"", "test_gdn_core")
VENDORED = {"qwen35-architecture.md", "vllm-pd-mtp-gdn.md", "hybrid-prefix-caching.md"}  # describe other code


def test_no_stale_references():
    """Docstrings and docs name what exists: no removed module or function, no section of a document outside
    the repository."""
    files = [p for d in ("jaxgdn", "pallas_kernels", "tests") for p in (ROOT / d).rglob("*.py")] + [
        ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    hits = [f"{p.relative_to(ROOT)}: {name}" for p in files if p.name not in VENDORED | {"test_readme.py"}
            for name in STALE if name in p.read_text()]
    assert not hits, hits
