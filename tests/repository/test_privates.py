"""No module of the library reaches into another module's privates.

A name with one leading underscore (``_shard_grad``, ``_reduce_scatter``) is
its module's own business: another module that reads it depends on what the
owner is free to change. So, read from the source with :mod:`ast`:

* ``x._name`` (``x`` not ``self``, ``cls`` or ``super()``) is allowed only in
  the module that defines ``_name`` (as a function, a class, a module-level
  name or an attribute it assigns). A private name minddp defines nowhere is
  torch's (``torch._C``, ``torch._foreach_add_``, ``distributed_c10d._...``):
  minddp must call some of those, and may; so may it reach into a module it
  imports from outside minddp (``os._exit``), whatever minddp names its own.
  A few private names are torch's although minddp defines them: MiniDDP
  carries them under torch's name so that code written for torch's DDP
  (Lightning's strategy) runs, and they are called as on torch's
  (``TORCHS_NAMES``).
* ``from minddp.a import _name`` is never allowed outside ``minddp.a``'s package
  module itself.

Dunders (``__init__``, ``x.__class__``) are not private.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO / "minddp"

# torch's private names that MiniDDP defines under torch's name, and the torch class whose name each is.
TORCHS_NAMES = {
    "_get_ddp_logging_data": DistributedDataParallel,
    "_delay_all_reduce": torch._C._distributed_c10d.Reducer,
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, module-level names, attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias) and node.asname:
            names.add(node.asname)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if _is_private(n)}


def foreign_modules(tree: ast.AST) -> set[str]:
    """The names a module binds by importing from outside minddp (``os``, ``dist``, ``nn``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] != "minddp")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] != "minddp":
            names.update(a.asname or a.name for a in node.names)
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _allowed_receiver(node: ast.expr, foreign: set[str]) -> bool:
    """``self``, ``cls``, ``super()``, or a module from outside minddp (``os``, ``torch.distributed``)."""
    if isinstance(node, ast.Name) and node.id in ("self", "cls"):
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super":
        return True
    root = _root(node)
    return isinstance(root, ast.Name) and root.id in foreign


@dataclass(frozen=True)
class Reach:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def reaches(sources: dict[str, str]) -> list[Reach]:
    """Every use, in ``sources`` (path -> text), of a private name another of them defines."""
    trees = {path: ast.parse(text, path) for path, text in sources.items()}
    defined = {path: defined_names(tree) for path, tree in trees.items()}
    anywhere = set().union(*defined.values()) - set(TORCHS_NAMES)
    found = []
    for path, tree in trees.items():
        foreign = foreign_modules(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr) and not _allowed_receiver(node.value, foreign):
                if node.attr in anywhere and node.attr not in defined[path]:
                    found.append(Reach(path, node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "minddp":
                for alias in node.names:
                    if _is_private(alias.name):
                        found.append(Reach(path, node.lineno, f"from {node.module} import {alias.name}"))
    return sorted(found, key=lambda r: (r.path, r.line))


def library_sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def test_no_library_module_uses_another_modules_privates():
    found = reaches(library_sources())
    assert not found, "private names used outside the module that defines them (make them public there, " \
                      "or give the owner a public method):\n" + "\n".join(map(str, found))


def test_torchs_names_are_torchs():
    assert all(hasattr(owner, name) for name, owner in TORCHS_NAMES.items())


def test_the_check_sees_a_reach_into_another_class_and_a_private_import():
    sources = {
        "pkg/owner.py": "class Owner:\n    def __init__(self):\n        self._secret = 1\n"
                        "def _helper():\n    pass\n",
        "pkg/user.py": "from minddp.pkg.owner import _helper\n"
                       "def use(owner):\n    return owner._secret\n",
    }
    assert [r.what for r in reaches(sources)] == ["from minddp.pkg.owner import _helper", "owner._secret"]


def test_the_check_allows_own_privates_a_parents_torchs_and_dunders():
    sources = {
        "pkg/owner.py": "class Owner:\n    def __init__(self):\n        self._secret = 1\n"
                        "    def same(self, other):\n        return other._secret + self._secret\n"
                        "def _exit():\n    pass\n",
        "pkg/user.py": "import os\nimport torch\nfrom minddp.pkg.owner import Owner\n"
                       "class Child(Owner):\n    def up(self):\n        return super()._secret, self._secret\n"
                       "def f(t, owner):\n    os._exit(0)\n"
                       "    return torch._foreach_add_, t._version, t.__class__, owner.secret\n",
    }
    assert reaches(sources) == []
