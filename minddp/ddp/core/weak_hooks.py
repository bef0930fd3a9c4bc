"""Gradient hooks that do not keep their owner alive.

[Note: a hook must not own its owner]
A hook registered with ``tensor.register_post_accumulate_grad_hook`` is held
by the tensor's autograd metadata, in C++, where Python's garbage collector
cannot look. A hook that holds its owner (a bound method holds its object)
closes a cycle, tensor -> hook -> owner -> tensor, that is never collected:
drop a MiniDDP, or a model under ``fully_shard``, and its parameters, bucket
buffers and process group stay alive until the interpreter exits (what that
costs there: [Note: a group must die before the interpreter] in
:mod:`minddp.launch.process_group`).

torch's C++ ``Reducer`` removes its hooks in its destructor. Here each hook
holds its owner weakly, and the hooks are removed once the owner is collected,
so a model that outlives its wrapper trains alone, as it did before.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["after_accumulation"]


class _WeakMethodHook:
    """``hook(tensor)`` calls ``method(*args, tensor)`` while the method's object lives, and nothing after."""

    __slots__ = ("_owner", "_function", "_args")

    def __init__(self, method: Callable[..., Any], args: tuple):
        self._owner = weakref.ref(method.__self__)
        self._function = method.__func__
        self._args = args

    def __call__(self, tensor: torch.Tensor) -> None:
        owner = self._owner()
        if owner is not None:
            self._function(owner, *self._args, tensor)


def _remove(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


def after_accumulation(method: Callable[..., Any], tensors: Iterable[torch.Tensor], *, with_index: bool = False) -> None:
    """Call ``method(tensor)`` (``method(index, tensor)`` with ``with_index``) after each tensor's gradient
    is accumulated, for as long as the method's object lives ([Note: a hook must not own its owner])."""
    handles = [tensor.register_post_accumulate_grad_hook(_WeakMethodHook(method, (i,) if with_index else ()))
               for i, tensor in enumerate(tensors)]
    finalizer = weakref.finalize(method.__self__, _remove, handles)
    finalizer.atexit = False  # at exit everything goes anyway
