"""The README's quickstart runs as written and prints what its comments say; docs and docstrings name what exists."""

import ast
import io
import re
import tokenize
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


VENDORED = {"qwen35-architecture.md", "vllm-pd-mtp-gdn.md", "hybrid-prefix-caching.md"}  # describe other code
# module names that also read as a variable or a checkpoint tensor's prefix in prose (state.x, mtp.fc)
AMBIGUOUS = {"state", "config", "request", "text", "inputs", "params", "cache", "mtp", "mlp", "gdn", "attention",
             "policy", "pd", "memory", "programs", "forward", "sampling", "model", "engine", "serve", "bench", "task",
             "llm", "eval", "steps", "common", "metrics", "protocol", "checkpoint", "rope", "norms", "role", "update",
             "core", "results", "tokenizer"}
DOTTED = re.compile(r"(?<![\w.])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def project():
    """(module dotted name -> its top-level names, class name -> its members)."""
    modules, classes = {}, {}
    for p in sorted(list(ROOT.glob("jaxgdn/**/*.py")) + list(ROOT.glob("pallas_kernels/*.py"))):
        rel = p.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        tree = ast.parse(p.read_text())
        top = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, ast.Assign):
                top |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                top.add(node.target.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                top |= {(a.asname or a.name).split(".")[0] for a in node.names}
        modules[name] = top
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                members = classes.setdefault(node.name, set())
                for n in ast.walk(node):
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        members.add(n.name)
                    elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                        members.add(n.target.id)
                    elif isinstance(n, ast.Assign):
                        members |= {t.id for t in n.targets if isinstance(t, ast.Name)}
                    elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                        members.add(n.attr)
    return modules, classes


def prose(p: Path):
    if p.suffix == ".md":
        yield p.read_text()
        return
    for tok in tokenize.generate_tokens(io.StringIO(p.read_text()).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            yield tok.string


def unresolved(ref: str, modules, classes) -> bool:
    parts = ref.split(".")
    if parts[-1] in ("py", "md", "json", "jinja", "txt", "toml", "safetensors", "sh", "png", "jsonl"):
        return False
    if parts[0] in ("jaxgdn", "pallas_kernels"):
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in modules:
                rest = parts[i:]
                return bool(rest) and rest[0] not in modules[".".join(parts[:i])] | {
                    m.rsplit(".", 1)[-1] for m in modules if m.startswith(".".join(parts[:i]) + ".")}
        return True
    a, b = parts[0], parts[1]
    by_base = {}
    for m, names in modules.items():
        by_base.setdefault(m.rsplit(".", 1)[-1], set()).update(names)
    if a in classes and a not in by_base:
        return b not in classes[a]
    if a in by_base and a not in AMBIGUOUS:
        members = set().union(*(classes.get(n, set()) for n in by_base[a]))
        return b not in by_base[a] | members
    return False


def test_every_dotted_name_in_docs_and_docstrings_resolves():
    """Each `module.name`, `Class.member` and `jaxgdn.x.y` that a docstring, a comment, the README or a doc names
    exists in the code (module names that read as variables in prose are left out); no document outside the
    repository is cited."""
    modules, classes = project()
    files = [p for d in ("jaxgdn", "pallas_kernels", "tests") for p in (ROOT / d).rglob("*.py")] + [
        ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    bad = sorted({f"{p.relative_to(ROOT)}: {ref}" for p in files if p.name not in VENDORED | {"test_readme.py"}
                  for text in prose(p)
                  for ref in DOTTED.findall(text) if unresolved(ref, modules, classes)})
    assert not bad, bad
    outside = [str(p.relative_to(ROOT)) for p in files if p.name not in VENDORED | {"test_readme.py"}
               and any(s in p.read_text() for s in ("reference §", "reference/", "anchors.md"))]
    assert not outside, outside


def test_the_resolver_flags_what_is_gone():
    modules, classes = project()
    assert unresolved("runner._advance_rows", modules, classes) and unresolved("LLMEngine._finish_if_done", modules, classes)
    assert unresolved("jaxgdn.engine.snapshots", modules, classes)
    assert not unresolved("update.Update", modules, classes) and not unresolved("Update.finish_if_done", modules, classes)
    assert not unresolved("jaxgdn.engine.core.EngineCore", modules, classes)
