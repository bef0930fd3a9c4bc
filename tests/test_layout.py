"""The package's shape: the core stands alone, and no module imports itself through others.

The import graph is read from the source with :mod:`ast` (every ``import``,
at module level or inside a function), so a cycle is found even where a
function-local import hides it from Python at import time.
"""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "minddp"
# Above the core: the training program, what the examples train on, the
# simulator's command-line helper that runs an example model to trace it, and
# MiniDDP inside accelerate and Lightning (each imports its framework).
UPPER_FLOOR = ("minddp.train", "minddp.data", "minddp.models", "minddp.simulate.record", "minddp.frameworks")


def _module_name(path: Path, package_dir: Path) -> str:
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..a import b
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # "from a import b" runs a (even when b is a submodule: a module that
            # does so from its own package imports its parent), and a.b if it is a module.
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # "import minddp.train.cli.x" -> the module part
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


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.a", "pkg.b", "pkg.a"]


def _core(graph: dict[str, set[str]]) -> list[str]:
    # A ``__main__`` module is a program (``python -m ...``): nothing imports
    # it, so it may use the examples' models like any script.
    return sorted(m for m in graph if not m.startswith(UPPER_FLOOR) and not m.endswith(".__main__"))


def test_the_core_never_imports_the_training_program_data_or_models():
    graph = import_graph()
    core = _core(graph)
    wrong = sorted((m, d) for m in core for d in graph[m] if d.startswith(UPPER_FLOOR))
    assert not wrong, f"core modules import the floor above them: {wrong}"


def test_core_imports_without_the_trainer_data_or_models():
    not_core = [*UPPER_FLOOR, "torchvision"]
    code = (
        f"import importlib, sys\nfor m in {_core(import_graph())!r}: importlib.import_module(m)\n"
        f"print([m for m in {not_core!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


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
    # outside. Not vacuous: the reducer imported minddp.net.bucket_planner (and
    # through it minddp.simulate) until the planner moved out.
    graph = import_graph()
    above = ("minddp.net.auto_buckets", "minddp.net.bucket_planner", "minddp.net.plan_trials", "minddp.simulate",
             "minddp.zero", "minddp.fsdp")
    path = ("minddp.ddp.reducer", "minddp.ddp.buckets", "minddp.ddp.bucket_assignment")
    parts = tuple(m for m in graph if m.startswith("minddp.ddp.parts"))  # the parts beside the path, too
    assert "minddp.ddp.parts.unused_parameters" in parts
    for module in path + parts:
        wrong = sorted(m for m in _imports_transitively(graph, module) if m.startswith(above))
        assert not wrong, f"{module} depends on the policies above it: {wrong}"


def test_the_plain_path_imports_no_part_feature_observer_or_policy():
    # The reducer holds its parts; it never imports one (reducer.py
    # imported a feature, and its base class two). Not vacuous: the graph
    # sees reducer.py's imports of the buckets.
    graph = import_graph()
    allowed = {"minddp.ddp.buckets", "minddp.ddp.bucket_assignment", "minddp.ddp.contracts",  # the slots' Protocols
               "minddp.ddp.messages"}  # the words of its errors, built only when one is raised
    assert "minddp.ddp.buckets" in graph["minddp.ddp.reducer"]
    for module in ("minddp.ddp.reducer", "minddp.ddp.buckets"):
        wrong = sorted(_imports_transitively(graph, module) - allowed)
        assert not wrong, f"{module} imports beyond the plain path: {wrong}"


def test_importing_the_wrapper_loads_no_simulator():
    # bucket_cap_mb="auto" needs the simulator; a default MiniDDP must not pay for it.
    code = "import minddp.ddp.wrapper, sys; assert 'minddp.simulate' not in sys.modules, sorted(m for m in sys.modules if 'simulate' in m)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE_DIR.parent)
    assert out.returncode == 0, out.stderr


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


CORE = ("minddp.ddp", "minddp.ddp.observers", "minddp.net.auto_buckets")


def layer_of(module: str) -> str:
    """The layer a module belongs to, for the package graph: the DDP core splits in
    three (what a step runs, the parts, and the wrapper that picks them)."""
    parts = module.split(".") + ["", ""]
    if parts[1] == "ddp":
        return {"parts": "ddp.parts", "observers": "ddp.observers", "wrapper": "ddp.wrapper",
                "": "ddp.wrapper"}.get(parts[2], "ddp")
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
    "ddp": set(),  # the reducer, buckets, and what the wrapper stands on (placement, broadcast, join, hooks)
    "ddp.parts": {"ddp"},
    "ddp.observers": {"ddp"},
    "launch": {"net"},  # spawn(..., link=...) enters a real link's namespace
    "net": {"ddp", "simulate"},  # the bucket planner replays the first steps' profile
    "ddp.wrapper": {"ddp", "ddp.parts", "ddp.observers", "net"},
}


def test_the_core_layers_point_one_way():
    # Not vacuous: the wrapper does import the parts, observers and the planner.
    layers = layer_graph()
    assert {"ddp.parts", "ddp.observers", "net"} <= layers["ddp.wrapper"]
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


if __name__ == "__main__":  # python tests/test_layout.py: the layers' graph, then the core's modules
    print_layer_graph()
    print()
    print_core_import_graph()
