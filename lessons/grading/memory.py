"""What a learner's objects hold: every tensor reachable from them, however it is kept.

Reading one attribute misses a copy kept anywhere else: another attribute, a
list in a dict, a closure, a global of the learner's module, the ``ctx`` of
an autograd Function. :func:`reachable_tensors` follows every reference the
garbage collector knows (``gc.get_referents``) from the objects given, and the
graph of autograd nodes (a custom Function's node *is* its ``ctx``); tensors
autograd saved for backward in C++ come from a ``saved_tensors_hooks`` list
the caller passes in. Walking only what the learner's objects reach is fast
(a walk of the whole heap takes a second on a rank) and leaves the grader's
own tensors out.

What the process holds at its peak is another question, asked of a stretch
of code rather than of objects: :class:`Followed` sees every tensor any op
makes while it is active (factories, copies, views, the outputs of
collectives, backward's gradients) and follows each until it is gone.

[Note: a storage counts once, whatever number of views of it are held; a
storage ``free()`` resized to 0 bytes counts 0.]
"""

from __future__ import annotations

import gc
import types
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_STOP = (type, types.ModuleType, str, bytes, int, float, bool, type(None), types.BuiltinFunctionType)


def reachable_tensors(*roots, modules=(), limit: int = 200_000) -> list[torch.Tensor]:
    """Every tensor reachable from ``roots`` (and from ``modules``: modules, or their globals' dicts): attributes, containers,
    closures, autograd nodes and their ctx; a tensor's ``.grad`` too. Modules other than ``modules`` are not
    entered; neither are classes."""
    seen, found = set(), []
    stack = list(roots) + [m if isinstance(m, dict) else vars(m) for m in modules]
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _STOP):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            if (obj.is_leaf or obj.retains_grad) and obj.grad is not None:  # others have no .grad to read
                stack.append(obj.grad)
            if obj.grad_fn is not None:
                stack.append(obj.grad_fn)
            continue
        if isinstance(obj, types.FunctionType):
            stack.extend(cell.cell_contents for cell in (obj.__closure__ or ()) if _filled(cell))
            stack.extend(obj.__defaults__ or ())
            continue
        if hasattr(obj, "next_functions"):  # an autograd node
            stack.extend(fn for fn, _ in obj.next_functions if fn is not None)
        stack.extend(gc.get_referents(obj))
    return found


def globals_of(obj) -> list:
    """The module globals of the code of ``obj``'s class (a learner's file is loaded by path, under no name in
    ``sys.modules``): what its methods' ``__globals__`` are."""
    for value in vars(type(obj)).values():
        function = getattr(value, "__func__", value)
        if isinstance(function, types.FunctionType):
            return [function.__globals__]
    return []


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def storage_bytes(tensors, excluded=()) -> int:
    """The bytes of the distinct storages of ``tensors``, less those ``excluded`` tensors use."""
    skip = {t.untyped_storage().data_ptr() for t in excluded if t is not None}
    counted, total = set(), 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in skip or storage.data_ptr() in counted:
            continue
        counted.add(storage.data_ptr())
        total += storage.nbytes()
    return total


class Followed(TorchDispatchMode):
    """While active, every tensor an op makes is followed until it is gone: ``alive()`` counts the bytes of the
    distinct storages of those still alive (``sizes``: only storages of those byte counts), and ``peak`` is the
    most ``alive()`` was after any op.

    [Note: the mode sits below autograd, so it sees backward's ops too (on CPU backward runs on the thread that
    called it, where the mode is active). A tensor's Python object lives as long as the tensor does, wherever
    it is kept (by autograd, by a C++ collective), so a weak reference to it dies exactly with it.]
    """

    def __init__(self):
        super().__init__()
        self._made: list[weakref.ref] = []
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {_storage_of(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        # a view or an in-place result shares a storage it was given: made before, or followed already
        self._made.extend(weakref.ref(t) for t in tree_leaves(out)
                          if isinstance(t, torch.Tensor) and _storage_of(t) not in given)
        self.peak = max(self.peak, self.alive())
        return out

    def tensors(self) -> list[torch.Tensor]:
        """The tensors made so far that are still alive."""
        alive = [t for t in (ref() for ref in self._made) if t is not None]
        self._made = [weakref.ref(t) for t in alive]
        return alive

    def alive(self, sizes=None) -> int:
        counted, total = set(), 0
        for t in self.tensors():
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in counted or (sizes is not None and storage.nbytes() not in sizes):
                continue
            counted.add(storage.data_ptr())
            total += storage.nbytes()
        return total


def _storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
