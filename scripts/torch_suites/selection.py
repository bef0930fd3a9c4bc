"""Which tests of a torch test class reach a class under test, read from the source (no test is run).

torch's large DDP suite keeps its 285 tests as methods of one class
(``DistributedTest._DistTestBase`` in ``distributed_test.py``), most of them
about collectives, not DDP. A test *reaches* a class when its own code, or the
code of a helper it calls (``self._helper(...)``, or a function or class defined
at the top of the same file), names that class. Reaching is followed through
any number of helpers, so ``test_DistributedDataParallel`` counts through
``self._test_DistributedDataParallel``.

The same walk gives the private names a test's code uses (``model._x``),
which the classification uses as a second witness when a test fails on a
torch-private method (see ``torch_suites/classify.py``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

TARGETS = ("DistributedDataParallel", "SyncBatchNorm", "DistributedSampler")
GPU_DECORATORS = ("skip_if_lt_x_gpu", "skip_if_no_gpu")  # the ones the runner re-targets to the CPU


@dataclass
class Reach:
    """What one test's code (with every helper it calls) names."""

    targets: set[str] = field(default_factory=set)  # the classes of TARGETS it names
    private_names: set[str] = field(default_factory=set)  # attribute names like ``_x`` (not ``__x__``)
    gpu_decorated: bool = False  # marked with one of GPU_DECORATORS


def _find_class(tree: ast.Module, class_name: str) -> ast.ClassDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return node
    raise LookupError(f"no class {class_name!r} in the source")


def _names_in(node: ast.AST) -> tuple[set[str], set[str], set[str]]:
    """Names, attribute names (not of ``self``) in ``node``'s body (not its decorators), and the ``self.x`` it uses."""
    names, attributes, on_self = set(), set(), set()
    body = node.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else [node]
    for statement in body:
        for sub in ast.walk(statement):
            if isinstance(sub, ast.Name):
                names.add(sub.id)
            elif isinstance(sub, ast.Attribute):
                if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    on_self.add(sub.attr)
                else:
                    attributes.add(sub.attr)
    return names, attributes, on_self


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _decorator_names(function: ast.FunctionDef) -> set[str]:
    found = set()
    for decorator in function.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        found.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return found


def reach_of_tests(source: str, class_name: str, targets: tuple[str, ...] = TARGETS) -> dict[str, Reach]:
    """``{test method name: Reach}`` for every ``test*`` method of ``class_name`` in ``source``."""
    tree = ast.parse(source)
    methods = {n.name: n for n in _find_class(tree, class_name).body if isinstance(n, ast.FunctionDef)}
    top_level = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    scanned: dict[tuple[str, str], tuple[set[str], set[str], set[str]]] = {}

    def scan(kind: str, name: str):
        if (kind, name) not in scanned:
            scanned[(kind, name)] = _names_in(methods[name] if kind == "method" else top_level[name])
        return scanned[(kind, name)]

    result = {}
    for test_name in (name for name in methods if name.startswith("test")):
        reach, seen, todo = Reach(), set(), [("method", test_name)]
        while todo:
            item = todo.pop()
            if item in seen:
                continue
            seen.add(item)
            names, attributes, on_self = scan(*item)
            reach.targets |= (names | attributes) & set(targets)
            reach.private_names |= {a for a in attributes if is_private(a)}
            todo += [("method", m) for m in on_self if m in methods]
            todo += [("top", n) for n in names if n in top_level]
        reach.gpu_decorated = bool(_decorator_names(methods[test_name]) & set(GPU_DECORATORS))
        result[test_name] = reach
    return result


def selected(reaches: dict[str, Reach]) -> list[str]:
    """The tests that reach at least one class under test, in source order."""
    return [name for name, reach in reaches.items() if reach.targets]


def matches(test_id: str, pattern: str | None) -> bool:
    """``-k``: no pattern, or one of its comma-separated parts is in the id (a part ending in ``$`` ends it)."""
    if not pattern:
        return True
    parts = [part for part in pattern.split(",") if part]
    return any(test_id.endswith(part[:-1]) if part.endswith("$") else part in test_id for part in parts)
