"""The repository's shape: a library and a lab beside it, imports one way, and no module imports itself.

``minddp`` is the library (torch alone); ``minddp_lab`` is the lab (the
simulator, the network model, real links, the bucket planner, the trainer,
the tests' harness), which imports the library and never the reverse. The
import graph is read from the source with :mod:`ast` (every ``import``, at
module level or inside a function), so a cycle or a wrong-way import is found
even where a function-local import hides it from Python at import time.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO / "minddp"
LAB_DIR = REPO / "minddp_lab"
# What a module of minddp.frameworks may import beyond torch: its framework.
FRAMEWORKS = {"minddp.frameworks.accelerate": {"accelerate"},
              "minddp.frameworks.lightning": {"lightning", "pytorch_lightning", "lightning_fabric"}}


def _module_name(path: Path, package_dir: Path) -> str:
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path, name: str, modules: set[str] = frozenset()) -> set[str]:
    """Every absolute name ``name``'s source imports, anywhere in it (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..a import b
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # "from a import b" runs a (even when b is a submodule: a module that
            # does so from its own package imports its parent), and a.b if it is a module.
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules)
    return found


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its source."""
    found = set()
    for target in _imported_names(path, name, modules):
        while target and target not in modules:  # "import minddp.ddp.core.reducer.x" -> the module part
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    paths = {_module_name(p, package_dir): p for p in sorted(package_dir.rglob("*.py"))}
    return {name: _imports(path, name, set(paths)) for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.parametrize("package_dir", [PACKAGE_DIR, LAB_DIR], ids=["minddp", "minddp_lab"])
def test_no_import_cycles(package_dir):
    cycle = find_cycle(import_graph(package_dir))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def package_graph(package_dir: Path) -> dict[str, set[str]]:
    """The graph between a package's parts (its subpackages and top-level modules), every import counted."""
    top = package_dir.name

    def part(module: str) -> str:
        return (module.split(".") + ["__init__"])[1]

    parts: dict[str, set[str]] = {}
    for module, imported in import_graph(package_dir).items():
        parts.setdefault(part(module), set()).update(part(d) for d in imported if d != top and part(d) != part(module))
    return parts


@pytest.mark.parametrize("package_dir", [PACKAGE_DIR, LAB_DIR], ids=["minddp", "minddp_lab"])
def test_no_cycle_between_a_packages_parts(package_dir):
    cycle = find_cycle(package_graph(package_dir))
    assert cycle is None, f"{package_dir.name}'s parts import each other: " + " -> ".join(cycle)


def test_the_part_graph_sees_a_cycle_between_two_subpackages(tmp_path):
    pkg = tmp_path / "pkg"
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from pkg.b.y import f\n")
    (pkg / "b" / "y.py").write_text("def f():\n    from pkg.a import z\n")
    (pkg / "a" / "z.py").write_text("")
    assert find_cycle(package_graph(pkg)) == ["a", "b", "a"]


def _library_modules() -> dict[str, Path]:
    return {_module_name(p, PACKAGE_DIR): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def test_the_library_never_imports_the_lab():
    # Not vacuous: the lab imports the library, and the finder reads both.
    lab_imports = {n for p in LAB_DIR.rglob("*.py") for n in _imported_names(p, _module_name(p, LAB_DIR))}
    assert any(n.startswith("minddp.") for n in lab_imports)
    wrong = sorted((m, n) for m, p in _library_modules().items() for n in _imported_names(p, m)
                   if n == "minddp_lab" or n.startswith("minddp_lab."))
    assert not wrong, f"library modules import the lab: {wrong}"


def test_the_library_needs_torch_alone():
    # Beyond the standard library, torch; minddp.frameworks' modules import their framework.
    wrong = []
    for module, path in _library_modules().items():
        allowed = {"torch", "minddp", "__future__", *FRAMEWORKS.get(module, ())}
        for name in _imported_names(path, module):
            top = name.split(".")[0]
            if top and top not in allowed and top not in sys.stdlib_module_names:
                wrong.append((module, name))
    assert not wrong, f"library modules import beyond torch and the standard library: {sorted(wrong)}"


def _loaded_after(code: str) -> list[str]:
    """The modules of the lab, torchvision and matplotlib loaded in a fresh interpreter after ``code``."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in sys.modules if m.split('.')[0] in " \
            "('minddp_lab', 'torchvision', 'matplotlib')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])


def test_import_minddp_loads_no_simulator_link_or_planner():
    assert _loaded_after("import minddp") == []
    # Not vacuous: the same probe sees the lab when it is imported.
    assert "minddp_lab.simulate.replay" in _loaded_after("import minddp_lab.auto")


def test_every_library_module_imports_without_the_lab():
    # Every module of the library but the frameworks' doors (they import their framework).
    modules = sorted(m for m in _library_modules() if not m.startswith("minddp.frameworks."))
    assert "minddp.ddp.wrapper" in modules and "minddp.launch.spawning" in modules
    assert _loaded_after(f"import importlib\nfor m in {modules!r}: importlib.import_module(m)") == []


def test_the_cycle_finder_sees_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.a", "pkg.b", "pkg.a"]


def _imports_transitively(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for nxt in graph.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def test_the_gradient_path_knows_no_policy_above_it():
    # Mechanism below, policy above: the reducer and its buckets offer an
    # interface (observers, rebuild, policies told at the end of a backward, bucket storage),
    # and the bucket planner, the simulator and ZeRO/FSDP drive it from
    # outside (the lab's planner too, which the library cannot import at all).
    graph = import_graph()
    above = ("minddp.zero", "minddp.fsdp")
    path = ("minddp.ddp.core.reducer", "minddp.ddp.core.buckets", "minddp.ddp.core.assignment")
    parts = tuple(m for m in graph if m.startswith("minddp.ddp.parts"))  # the parts beside the path, too
    assert "minddp.ddp.parts.unused_parameters" in parts
    for module in path + parts:
        wrong = sorted(m for m in _imports_transitively(graph, module) if m.startswith(above))
        assert not wrong, f"{module} depends on the policies above it: {wrong}"


def test_the_core_imports_nothing_of_minddp_outside_it():
    # A learner reads minddp/ddp/core/ alone: its modules import torch and each other, nothing else of
    # minddp (no part, observer, policy, nor the wrapper). Not vacuous: the reducer imports the buckets.
    graph = import_graph()
    core = sorted(m for m in graph if m.startswith("minddp.ddp.core"))
    assert "minddp.ddp.core.buckets" in graph["minddp.ddp.core.reducer"], core
    for module in core:
        wrong = sorted(m for m in _imports_transitively(graph, module)
                       if m != "minddp" and not m.startswith("minddp.ddp.core"))
        assert not wrong, f"{module} imports beyond the core: {wrong}"


def test_no_class_is_changed_at_run_time_outside_fsdp():
    # Options are parts chosen at construction, not classes swapped under a
    # live object; fully_shard's one __class__ assignment is FSDP2's own API.
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if "fsdp" in path.relative_to(PACKAGE_DIR).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            calls_setattr = (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
                             and len(node.args) > 1 and getattr(node.args[1], "value", None) == "__class__")
            if calls_setattr or any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in targets):
                found.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{node.lineno}")
    assert not found, f"__class__ assigned at run time: {found}"


CORE = ("minddp.ddp", "minddp.ddp.core", "minddp.ddp.observers")


def layer_of(module: str) -> str:
    """The layer a module belongs to, for the package graph: the DDP package splits in
    five (the core a plain step runs, what the wrapper stands on, the parts, the observers,
    and the wrapper that picks them, with its methods beyond the plain path)."""
    parts = module.split(".") + ["", ""]
    if parts[1] == "ddp":
        return {"core": "ddp.core", "parts": "ddp.parts", "observers": "ddp.observers", "wrapper": "ddp.wrapper",
                "later_options": "ddp.wrapper", "torch_surface": "ddp.wrapper", "": "ddp.wrapper"}.get(parts[2], "ddp")
    return parts[1] or "minddp"


def layer_graph() -> dict[str, set[str]]:
    graph = import_graph()
    layers: dict[str, set[str]] = {}
    for module, imported in graph.items():
        layer = layer_of(module)
        layers.setdefault(layer, set()).update(layer_of(d) for d in imported if layer_of(d) != layer)
    return layers


# What each layer of the core may import (besides itself): dependencies point one
# way, from the wrapper that chooses down to the mechanism it chooses among.
MAY_IMPORT = {
    "ddp.core": set(),  # the reducer, its slots, the buckets: torch alone
    "ddp": {"ddp.core"},  # what the wrapper stands on (placement, broadcast, comm hooks, the policies)
    "ddp.parts": {"ddp", "ddp.core"},
    "ddp.observers": {"ddp", "ddp.core"},
    "launch": set(),  # spawn(..., rank_setup=...): a real link's namespace is the lab's (minddp_lab.links)
    "ddp.wrapper": {"ddp", "ddp.core", "ddp.parts", "ddp.observers"},
}


def test_the_core_layers_point_one_way():
    # Not vacuous: the wrapper does import the parts and the observers.
    layers = layer_graph()
    assert {"ddp.parts", "ddp.observers"} <= layers["ddp.wrapper"]
    wrong = {layer: sorted(layers.get(layer, set()) - allowed) for layer, allowed in MAY_IMPORT.items()}
    assert not any(wrong.values()), f"layers importing beyond what they may: {wrong}"


def print_layer_graph() -> None:
    """One line per layer: the layers it imports (docs/reading_the_code.md)."""
    for layer, imported in sorted(layer_graph().items()):
        print(f"{layer:<14} -> {', '.join(sorted(imported)) or '(nothing of minddp)'}")


def print_core_import_graph() -> None:
    """One line per module of the DDP core: what it imports from minddp (docs/reading_the_code.md)."""
    graph = import_graph()
    for module in sorted(m for m in graph if any(m == c or m.startswith(c + ".") for c in CORE)):
        imports = sorted(d.removeprefix("minddp.") for d in graph[module] if d != "minddp")
        print(f"{module.removeprefix('minddp.'):<31} -> {', '.join(imports) or '(nothing of minddp)'}")


if __name__ == "__main__":  # python tests/repository/test_layout.py: the layers' graph, then the core's modules
    print_layer_graph()
    print()
    print_core_import_graph()
