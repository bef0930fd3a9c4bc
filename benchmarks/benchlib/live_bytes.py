"""Peak live tensor bytes over a window, from every allocation: a ``TorchDispatchMode``.

Why not the allocator or RSS: on CPU there is no ``max_memory_allocated``,
and RSS keeps freed blocks (see ``benchlib/memory.py``). A dispatch mode sees every
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

**Model state apart.** Beside every live byte (``peak``), the peak of *model
state* (``peak_state``): what the ZeRO paper's formula counts, parameters,
gradients and optimizer state, plus what a wrapper needs to move them (its
gathered units, buckets, send and receive buffers). A storage is model state
if, at any time in the window, it was

* a parameter's (seen at every module's forward pre-hook, after a sharding
  wrapper has gathered it: a gathered unit is state),
* a parameter's gradient (a hook on every such parameter sees each gradient
  autograd hands it, before it is accumulated, kept or sent),
* a tensor a collective touched (every ``c10d`` operation's tensors), or
* alive between steps: when the measured step begins (:meth:`reset_peak`)
  or when :attr:`peak_state` is read after it (parameters, optimizer state,
  gradients a wrapper wrote, buffers kept from step to step; a training
  loop holds nothing else between steps).

Everything else is activations: what autograd saved, the gradients flowing
between layers in backward, operators' temporaries, inputs and the loss.
Whether a storage is state is known only once the window has seen it all (a
tensor born in backward may be handed to a parameter as its gradient), so
the peak of model state is replayed from the window's log of allocations
and frees at the end.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as live: ...``; then ``live.peak``, ``live.peak_state``, ``live.current``."""

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._live: dict[int, tuple[int, int]] = {}  # id(storage) -> (serial, bytes counted)
        self._serials = itertools.count()
        self._state: set[int] = set()  # serials of storages found to be model state
        self._at_reset: dict[int, int] = {}  # serial -> bytes, live when the measured step began
        self._log: list[tuple[int, int]] = []  # (serial, change in bytes) since then
        self._resize = None

    # ------------------------------------------------------------------ the window
    def __enter__(self):
        self._resize = original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, nbytes):
            before = storage.nbytes()
            out = original(storage, nbytes)
            if id(storage) in tracker._live:
                tracker._add(id(storage), storage.nbytes() - before)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def reset_peak(self) -> None:
        """The measured step begins: peaks from what is live now."""
        self.peak = self.current
        self._at_reset = dict(self._live.values())
        self._log = []

    @property
    def peak_state(self) -> int:
        """The most bytes of model state live at once since :meth:`reset_peak` (replayed from the log)."""
        between_steps = set(self._at_reset) | {serial for serial, _ in self._live.values()}
        state = self._state | between_steps
        current = sum(nbytes for serial, nbytes in self._at_reset.items() if serial in state)
        peak = current
        for serial, change in self._log:
            if serial in state:
                current += change
                peak = max(peak, current)
        return peak

    # ------------------------------------------------------------------ what is seen
    def track(self, *tensors) -> None:
        """Count tensors that exist already (made before the window), nested lists and dicts too."""
        for t in tree_leaves(tensors):
            if torch.is_tensor(t):
                self._see(t)

    def mark_state(self, *tensors) -> None:
        """Count these tensors' storages as model state (buffers a peer communicates through its own
        transport, which no ``c10d`` operation sees: DeepSpeed's reduce buckets on CPU)."""
        for t in tree_leaves(tensors):
            if torch.is_tensor(t):
                self._mark(t)

    def watch_parameters(self, model: torch.nn.Module) -> None:
        """Learn each module's parameters as it runs (after sharding wrappers gathered them), and their gradients."""
        hooked: set[int] = set()

        def note(module, _args):
            for name in module._parameters:
                p = getattr(module, name, None)
                if not torch.is_tensor(p):
                    continue
                self._mark(p)
                if p.requires_grad and p.is_leaf and id(p) not in hooked:
                    hooked.add(id(p))  # parameters live as long as the model: ids are not reused
                    p.register_hook(lambda grad: self._mark(grad))

        for m in model.modules():
            m.register_forward_pre_hook(note)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if torch.is_tensor(t):
                self._see(t)
        if func.namespace == "c10d":  # a collective's tensors: communication buffers
            for t in tree_leaves((args, kwargs)):
                if torch.is_tensor(t):
                    self._mark(t)
        return out

    def _see(self, t: torch.Tensor) -> None:
        for plain in _plain_tensors(t):
            storage = plain.untyped_storage()
            key = id(storage)
            if key in self._live:
                continue
            self._live[key] = (next(self._serials), 0)
            self._add(key, storage.nbytes())
            weakref.finalize(storage, self._forget, key)

    def _mark(self, t: torch.Tensor) -> None:
        """``t``'s storage is model state."""
        for plain in _plain_tensors(t):
            self._see(plain)
            self._state.add(self._live[id(plain.untyped_storage())][0])

    # ------------------------------------------------------------------ the books
    def _add(self, key: int, nbytes: int) -> None:
        serial, counted = self._live[key]
        self._live[key] = (serial, counted + nbytes)
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self._log.append((serial, nbytes))

    def _forget(self, key: int) -> None:
        serial, nbytes = self._live.pop(key, (None, 0))
        self.current -= nbytes
        if serial is not None:
            self._log.append((serial, -nbytes))


def _plain_tensors(t: torch.Tensor):
    """The tensors with storage behind ``t``: itself, or a subclass's (a DTensor's) inner ones; none on meta."""
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name)
            if torch.is_tensor(inner):
                yield from _plain_tensors(inner)
    elif t.device.type != "meta":
        yield t
