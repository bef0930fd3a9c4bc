"""Peak live tensor bytes over a window, from every allocation: a ``TorchDispatchMode``.

Why not the allocator or RSS: on CPU there is no ``max_memory_allocated``,
and RSS keeps freed blocks (see ``_memory.py``). A dispatch mode sees every
aten operation a rank runs, so it sees every tensor created: this one adds a
storage's bytes when an operation first returns it and subtracts them when
the storage's Python object dies (a weak reference; torch keeps one Python
object per storage while anything holds it, views included). Storages
resized in place (torch's FSDP2 frees and re-allocates its gathered
parameters with ``untyped_storage().resize_``, an operation no dispatch mode
sees) are followed by wrapping ``UntypedStorage.resize_`` for the window.
Tensor subclasses (FSDP2's DTensors) are counted by their inner tensors.

What it cannot see: memory a backend allocates in C++ without a tensor
(Gloo's own transfer buffers), and tensors created before the window that
are not handed to :meth:`LiveBytes.track`.

**Activations apart.** Beside the total, the tracker keeps what autograd
saves for backward (``saved_tensors_hooks``) unless it is a parameter's
storage (parameters are seen at every module's forward pre-hook, after any
sharding wrapper has gathered them): the peak of *model state* (parameters,
gathered units, gradients, optimizer state, communication buffers) is the
peak of total minus those activations. Temporaries of backward (gradients
flowing between layers) stay in the total and in model state: small batches
keep them small.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as live: ...``; then ``live.peak``, ``live.peak_state``, ``live.current``."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self.saved: set[int] = set()  # storages autograd saved that are not parameters
        self.parameters: set[int] = set()
        self.current = self.current_saved = 0
        self.peak = self.peak_state = 0
        self._resize = None

    # ------------------------------------------------------------------ the window
    def __enter__(self):
        self._resize = original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, nbytes):
            before = storage.nbytes()
            out = original(storage, nbytes)
            if id(storage) in tracker.sizes:
                tracker._add(id(storage), storage.nbytes() - before)
            return out

        torch.UntypedStorage.resize_ = resize_
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        self._hooks.__exit__(*exc)
        return super().__exit__(*exc)

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.current
        self.peak_state = self.current - self.current_saved

    # ------------------------------------------------------------------ what is seen
    def track(self, *tensors) -> None:
        """Count tensors that exist already (made before the window), nested lists and dicts too."""
        for t in tree_leaves(tensors):
            if torch.is_tensor(t):
                self._see(t)

    def watch_parameters(self, model: torch.nn.Module) -> None:
        """Learn each module's parameters as it runs (after sharding wrappers gathered them): not activations."""
        def note(module, _args):
            for name in module._parameters:
                p = getattr(module, name, None)
                if torch.is_tensor(p):
                    self.parameters.add(id(p.untyped_storage()))

        for m in model.modules():
            m.register_forward_pre_hook(note)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if torch.is_tensor(t):
                self._see(t)
        return out

    def _see(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if torch.is_tensor(inner):
                    self._see(inner)
            return
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.sizes:
            return
        self.sizes[key] = 0
        self._add(key, storage.nbytes())
        weakref.finalize(storage, self._forget, key)

    def _pack(self, t):
        if torch.is_tensor(t) and not is_traceable_wrapper_subclass(t) and t.device.type != "meta":
            key = id(t.untyped_storage())
            if key in self.sizes and key not in self.parameters and key not in self.saved:
                self.saved.add(key)
                self.current_saved += self.sizes[key]
        return t

    # ------------------------------------------------------------------ the books
    def _add(self, key: int, nbytes: int) -> None:
        self.sizes[key] += nbytes
        self.current += nbytes
        if key in self.saved:
            self.current_saved += nbytes
        self.peak = max(self.peak, self.current)
        self.peak_state = max(self.peak_state, self.current - self.current_saved)

    def _forget(self, key: int) -> None:
        nbytes = self.sizes.pop(key, 0)
        self.current -= nbytes
        if key in self.saved:
            self.saved.discard(key)
            self.current_saved -= nbytes
        self.parameters.discard(key)
