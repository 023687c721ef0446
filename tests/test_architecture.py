"""The package's layering (issue 26, ARCHITECTURE.md): no import circle, and an engine that imports nothing from
``algorithms/``. Every import statement counts, including those inside functions: a circle hidden in a
function body is still a circle, it only fails later."""

from __future__ import annotations

import ast
from pathlib import Path

import fedistill

PACKAGE = Path(fedistill.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (``from a import b`` counts ``a``, and ``a.b`` where that is a module)."""
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets.add(module)
                targets.update(f"{module}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_function_level_imports_and_finds_a_planted_circle():
    graph = import_graph()
    # runner imports the summary helpers inside a function: the walker must see it.
    assert "fedistill.engine.summary" in graph["fedistill.runner"]
    planted = {k: set(v) for k, v in graph.items()}
    planted["fedistill.config"].add("fedistill.runner")  # runner imports config; the reverse closes a circle
    assert any({"fedistill.config", "fedistill.runner"} <= set(c) for c in cycles(planted))


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_the_engine_imports_nothing_from_the_algorithms():
    """The engine runs the Algorithm it is handed (fedistill.protocol); the composition roots (fedistill.simulation,
    the runner, the Flower apps) build it."""
    graph = import_graph()
    offending = {
        module: sorted(t for t in targets if t == "fedistill.algorithms" or t.startswith("fedistill.algorithms."))
        for module, targets in graph.items()
        if module.startswith("fedistill.engine")
    }
    assert {m: t for m, t in offending.items() if t} == {}
    # and the protocol below both needs nothing above the models
    assert all(t.startswith("fedistill.models") for t in graph["fedistill.protocol"])


def test_the_experiment_layer_is_one_subpackage_that_nothing_below_imports():
    """Issue 62 item 10: presets, bench suites and ranking live in ``fedistill.studies``; the top level shows the
    layers. Only the command line and the public API may import the studies, never the engine, the methods, the
    report helpers or the one-run composition roots."""
    graph = import_graph()
    top_level = {p.stem for p in PACKAGE.glob("*.py")}
    assert not top_level & {"bench", "bench_results", "bench_rank", "reproduce", "reproduce_tables"}
    assert {"fedistill.studies.reproduce", "fedistill.studies.bench", "fedistill.studies.bench_rank"} <= set(graph)
    allowed = {"fedistill.cli", "fedistill.api", "fedistill"}
    importers = {
        module
        for module, targets in graph.items()
        if not module.startswith("fedistill.studies") and any(t.startswith("fedistill.studies") for t in targets)
    }
    assert importers <= allowed, sorted(importers - allowed)
    assert "fedistill.studies.reproduce" in graph["fedistill.cli"]  # and the walker does see the CLI's lazy import


def test_a_long_source_file_says_why_at_its_top():
    """ARCHITECTURE.md: files stay under about 500 lines; a longer one states its reason in its module docstring."""
    unexplained = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 550:
            docstring = ast.get_docstring(ast.parse(text)) or ""
            if "Length (over the ~500-line guide" not in docstring:
                unexplained.append(str(path.relative_to(PACKAGE)))
    assert unexplained == []
