"""The code's layering: kernels <- model <- engine <- entry points (LLM, CLIs) <- benchmarks, with no back edge,
and no module much past one job's size. Read from the sources, nothing imported."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a module's layer, by its dotted name's prefix (longest first); a module may import its own layer and lower ones
LAYERS = [("pallas_kernels", 0), ("jaxgdn.model", 1), ("jaxgdn.engine", 2), ("jaxgdn.bench", 4), ("jaxgdn", 3)]
ENTRY_POINTS_THAT_ARE_NOT_BENCHES = ("jaxgdn.eval", "jaxgdn.generate", "jaxgdn.train", "jaxgdn.llm")


def layer(module: str) -> int | None:
    for prefix, level in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return level
    return None


def modules():
    for path in sorted(list(ROOT.glob("jaxgdn/**/*.py")) + list(ROOT.glob("pallas_kernels/*.py"))):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        yield name, path


def imports(name: str, path: Path):
    """The project modules a module imports (relative imports resolved), anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_imports_never_reach_up_a_layer():
    back_edges = []
    for name, path in modules():
        mine = layer(name)
        for target in imports(name, path):
            theirs = layer(target)
            if theirs is not None and theirs > mine:
                back_edges.append(f"{name} -> {target}")
            if name in ENTRY_POINTS_THAT_ARE_NOT_BENCHES and target.startswith("jaxgdn.bench"):
                back_edges.append(f"{name} -> {target}")
    assert not back_edges, back_edges


def test_modules_stay_near_one_jobs_size():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules()}
    assert sizes and not {n: s for n, s in sizes.items() if s > 400}, sorted(sizes.items(), key=lambda kv: -kv[1])[:5]


def import_graph() -> dict[str, set[str]]:
    """Each project module -> the project modules it imports (`from pkg import mod` counts as mod)."""
    names = dict(modules())
    graph = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                subs = {f"{target}.{a.name}" for a in node.names} & names.keys()
                deps |= subs or ({target} & names.keys())
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names} & names.keys()
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycles_finds_a_loop_and_only_loops():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []


def test_no_module_imports_itself_through_others():
    """No import cycle anywhere in jaxgdn or pallas_kernels, TYPE_CHECKING and function-level imports included."""
    assert cycles(import_graph()) == []
