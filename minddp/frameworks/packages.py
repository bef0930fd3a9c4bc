"""Which Lightning package a MiniDDP strategy is built for.

Lightning ships twice: the standalone packages (``pytorch_lightning``, ``lightning_fabric``) and the unified
``lightning`` (``lightning.pytorch``, ``lightning.fabric``), two copies of the same code whose classes are
distinct: ``lightning.Trainer`` refuses a strategy subclassing ``pytorch_lightning``'s ``DDPStrategy`` as
"invalid". So each MiniDDP strategy exists once per package, and ``MiniDDPStrategy(...)`` picks the one for
the package the training script uses (:func:`chosen_package`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from typing import Any

__all__ = ["OnePerPackage", "chosen_package", "built_on", "find_built"]


def chosen_package(standalone: str, unified: str, package: str | None) -> str:
    """``package`` if given; else the one of ``standalone`` / ``unified`` the script has imported; else the
    installed one. Both imported: ambiguous, so refused, naming ``package=``."""
    choices = (standalone, unified)
    if package is not None:
        if package not in choices:
            raise ValueError(f"package={package!r}: MiniDDPStrategy is built for {standalone!r} or {unified!r}")
        return package
    imported = [name for name in choices if name in sys.modules]
    if len(imported) == 2:
        raise ValueError(
            f"both {standalone!r} and {unified!r} are imported, and their strategies are different classes: "
            f"say which one your Trainer or Fabric comes from, MiniDDPStrategy(package={unified!r}) or "
            f"MiniDDPStrategy(package={standalone!r})")
    if imported:
        return imported[0]
    installed = [name for name in choices if importlib.util.find_spec(name.split(".")[0]) is not None]
    if not installed:
        raise ModuleNotFoundError(f"neither {standalone!r} nor {unified!r} is installed: from a clone of minddp, "
                                  "pip install -e '.[frameworks]'")
    return installed[0]


@functools.cache
def built_on(ours: type, package: str, base: str) -> type:
    """``ours`` on ``package``'s class ``base`` (a path in the package, e.g. ``"strategies.ddp.DDPStrategy"``),
    with ``package`` as a class attribute, named ``<ours>_<package>`` in ``ours``'s module, where pickle finds
    it (a ``spawn`` launch pickles the strategy; that module's ``__getattr__`` is :func:`find_built`)."""
    module, _, name = base.rpartition(".")
    built_name = f"{ours.__name__}_{package.replace('.', '__')}"
    cls = type(built_name, (ours, getattr(importlib.import_module(f"{package}.{module}"), name)),
               {"package": package, "__module__": ours.__module__, "__qualname__": built_name})
    setattr(sys.modules[ours.__module__], built_name, cls)
    return cls


def find_built(name: str, bases: dict[type, str], packages: tuple[str, ...]) -> type:
    """The class :func:`built_on` names ``name``, built on first use (in a process that unpickles one)."""
    for ours, base in bases.items():
        for package in packages:
            if name == f"{ours.__name__}_{package.replace('.', '__')}":
                return built_on(ours, package, base)
    raise AttributeError(f"module {next(iter(bases)).__module__!r} has no attribute {name!r}")


class OnePerPackage:
    """A class built once per Lightning package (:func:`built_on`): ``Cls(..., package=None)`` makes an
    instance of the one for :func:`chosen_package`. A subclass names ``packages`` and its ``base``."""

    packages: tuple[str, str]  # (standalone, unified)
    base: str  # the class each is built on, a path in the package
    package: str  # set on each built class

    def __new__(cls, *args: Any, package: str | None = None, **kwargs: Any) -> Any:
        if "package" not in cls.__dict__:  # the class the user names, not one built for a package
            cls = built_on(cls, chosen_package(*cls.packages, package), cls.base)
        return super().__new__(cls)

    def __init__(self, *args: Any, package: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
