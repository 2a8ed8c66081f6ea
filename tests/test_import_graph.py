"""The layers of `jstrategy/_src` (docs/ARCHITECTURE.md, "Layers"), read from the imports.

Every import counts: module level, inside functions, and type-only ones under
``if TYPE_CHECKING``.
"""

import ast
import pathlib

import jstrategy

PACKAGE = pathlib.Path(jstrategy.__file__).parent
SRC = "jstrategy._src"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _graph(*, type_only: bool) -> dict[str, set[str]]:
    """Module -> the `jstrategy._src` modules it imports (with or without type-only ones)."""
    modules = _modules()

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        if not module.startswith(SRC):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = set()
        if not type_only:
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    skipped |= {id(n) for n in ast.walk(node)}
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                edges |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    prefix = package
                    for _ in range(node.level - 1):
                        prefix = prefix.rpartition(".")[0]
                    base = f"{prefix}.{base}" if base else prefix
                for a in node.names:
                    full = f"{base}.{a.name}"
                    edges.add(full if full in modules else resolve(base))
        graph[module] = {e for e in edges if e.startswith(SRC) and e != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_core_imports_nothing_of_the_training_layer_not_even_for_types():
    graph = _graph(type_only=True)
    training = f"{SRC}.training"
    # The Keras 3 route (`_src/keras3/`) is a layer above training: it adapts Keras's
    # losses to jstrategy's.
    above = (training, f"{SRC}.keras3")
    offenders = {
        module: sorted(d for d in deps if d.startswith(training))
        for module, deps in graph.items()
        if not module.startswith(above)
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def test_no_import_cycle_not_even_through_type_only_imports():
    assert _cycles(_graph(type_only=False)) == []
    assert _cycles(_graph(type_only=True)) == []
