"""The benchmarks' shared code is one package, ``benchmarks/benchlib``, imported by name: no import cycle
within it, and no script reaches it through ``sys.path``."""

import ast
from pathlib import Path

from test_layout import find_cycle, import_graph

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PACKAGE = BENCHMARKS / "benchlib"


def test_the_benchmark_package_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert "benchlib.report" in graph and "benchlib.prediction" in graph["benchlib.report"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_script_imports_a_helper_module_outside_the_package():
    """The helpers once lay beside the scripts as ``_name.py``; none is left there, none is imported so."""
    assert not sorted(p.name for p in BENCHMARKS.glob("_*.py"))
    for script in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text(), str(script))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("_") and n != "__future__" for n in names), f"{script.name} imports {names}"
