"""Watch a learner's collectives: when each was launched, in which step, its bytes, and when it was waited for.

An async all-reduce on Gloo writes its sum into the tensor whenever it
finishes: code that reads the tensor before ``wait()`` is wrong, yet often
reads the right sum by luck. The watched ``dist.all_reduce`` takes that luck
away. It sums a private copy of the tensor and hands back a ``HeldWork``
that writes the sum into the learner's tensor only when ``wait()`` is called
(or the future from ``get_future()`` completes): reading early reads this
rank's own numbers, every time; a collective whose output is not its input (an
all-gather, a reduce-scatter) leaves NaN there until then (``EARLY``), so a
read before the wait shows as NaN downstream. Waiting for that future, alone or through
``torch.futures.wait_all``, counts as a wait. ``HeldWork`` also notes
whether the tensor was changed between the launch and the wait (a division
written before the wait), and lives only as long as the learner holds it
(``handles()`` lists those, for a step that never lets go of what it
launched). Every collective the exercises invite is watched alike
(``WATCHED``: the all-reduce, the all-gathers, the reduce-scatters, the
broadcast): an asynchronous one writes its output only at ``wait()``.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Launch:
    at: float  # perf_counter
    step: int
    is_async: bool
    numel: int  # of the tensor sent (the input)
    name: str = "all_reduce"
    nbytes: int = 0  # of the tensor sent
    dtypes: set = field(default_factory=set)  # of the tensors sent, as "float32"
    sent: torch.Tensor | None = None  # a copy of what was sent, flat (``Watch(keep_sent=True)``)

    def moved(self, world_size: int) -> float:
        """Bytes each rank sends for this collective in the bandwidth-optimal algorithm (a ring's): what any
        algorithm for it must move. An all-reduce is a reduce-scatter then an all-gather, each (N-1)/N of the
        whole tensor; an all-gather's input is one rank's piece of the whole; a pipelined broadcast forwards it."""
        share = (world_size - 1) / world_size
        if self.name == "all_reduce":
            return 2 * share * self.nbytes
        if self.name.startswith("all_gather"):
            return share * world_size * self.nbytes
        return share * self.nbytes  # broadcast, reduce-scatter (whose input is the whole)


def _outputs(name: str, args: tuple) -> list[torch.Tensor]:
    """The tensors a collective writes: its first argument (a list of them for ``all_gather`` / ``reduce_scatter``'s
    output list); for ``all_reduce`` and ``broadcast`` the tensor sent is also the one written."""
    first = args[0]
    return list(first) if isinstance(first, (list, tuple)) else [first]


def _sent(name: str, args: tuple) -> list[torch.Tensor]:
    """The tensors a collective sends from this rank."""
    if name in ("all_reduce", "broadcast"):
        return [args[0]]
    second = args[1]
    return list(second) if isinstance(second, (list, tuple)) else [second]


# the collectives watched: the stubs invite these
WATCHED = tuple(name for name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
                                  "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")
                if hasattr(dist, name))  # the *_single names: exercise 21's stub takes them where torch has them


# What an asynchronous all-gather's or reduce-scatter's output holds until its wait() returns: a read before then
# shows as NaN wherever the numbers went.
EARLY = float("nan")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other has NaN."""
    if not (a.is_floating_point() and b.is_floating_point()):
        return torch.equal(a, b)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


class _Delivery:
    """Writes the finished result into the learner's tensors, once; notes a tensor changed since its launch."""

    def __init__(self, tensors: list[torch.Tensor], privates: list[torch.Tensor], watch: "Watch"):
        self.tensors, self.privates, self.watch = tensors, privates, watch
        self.launched = [t.detach().clone() for t in tensors]
        self.done = False

    @property
    def tensor(self) -> torch.Tensor:
        return self.tensors[0]

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        for tensor, private, launched in zip(self.tensors, self.privates, self.launched):
            if not _same(tensor, launched):
                self.watch.changed_before_wait += 1
            tensor.copy_(private)


class HeldWork:
    """The learner's handle: the sum reaches their tensor at ``wait()`` (or completion seen), never earlier."""

    def __init__(self, work, delivery: _Delivery, step: int):
        self._work, self._delivery = work, delivery  # the delivery does not refer back: no cycle through C++
        self.step = step

    def wait(self, *args, **kwargs):
        self._delivery.watch.waits.append(time.perf_counter())
        result = self._work.wait(*args, **kwargs)
        self._delivery()
        return result

    def is_completed(self) -> bool:
        if self._work.is_completed():
            self._delivery()
            return True
        return False

    def get_future(self):
        delivery = self._delivery

        def delivered(future):
            future.value()
            delivery()
            return list(delivery.tensors)
        return WatchedFuture(self._work.get_future().then(delivered), delivery.watch.waits)

    def __getattr__(self, name):
        return getattr(self._work, name)


class WatchedFuture:
    """The learner's future: notes when it is waited for, directly or through ``torch.futures.wait_all``."""

    def __init__(self, future, waits: list):
        self._future, self._waits = future, waits

    def wait(self):
        self._waits.append(time.perf_counter())
        return self._future.wait()

    def value(self):
        self._waits.append(time.perf_counter())
        return self._future.value()

    def then(self, callback):
        return WatchedFuture(self._future.then(callback), self._waits)

    def __getattr__(self, name):
        return getattr(self._future, name)


def _unwrapped(futures) -> list:
    """torch's own futures, for ``torch.futures.wait_all`` and ``collect_all``, which hand them to C++."""
    return [f._future if isinstance(f, WatchedFuture) else f for f in futures]


class Watch:
    """While active, every watched collective is recorded (a ``Launch``); async ones are held back until waited for."""

    def __init__(self, keep_sent: bool = False):
        self.keep_sent = keep_sent  # keep a copy of each tensor sent (``Launch.sent``)
        self.launches: list[Launch] = []
        self.waits: list[float] = []
        self.step = -1  # set by the bench at each step's start (-1: before the first, e.g. the first broadcast)
        self.changed_before_wait = 0  # tensors written between their launch and their wait()
        self._handles = weakref.WeakSet()

    def per_step(self, steps: int, name: str = "all_reduce") -> list[int]:
        """Collectives ``name`` launched in each step."""
        return [sum(launch.step == s and launch.name == name for launch in self.launches) for s in range(steps)]

    def bytes_per_step(self, steps: int) -> list[int]:
        """Bytes sent by every watched collective, in each step."""
        return [sum(launch.nbytes for launch in self.launches if launch.step == s) for s in range(steps)]

    def handles(self) -> list["HeldWork"]:
        """The handles the learner still holds (each knows the step it was launched in)."""
        return list(self._handles)

    @contextlib.contextmanager
    def active(self, *modules):
        """Watch ``dist``'s collectives, and in each of ``modules`` the names bound to one of them (a stub's
        ``reduce_scatter = dist.reduce_scatter_tensor`` is bound at import, before the watch starts)."""
        originals = {name: getattr(dist, name) for name in WATCHED}
        aliases = [(module, alias, name) for module in modules for alias, value in vars(module).items()
                   for name, original in originals.items() if value is original]

        def watched(name):
            original = originals[name]

            def collective(*args, async_op=False, **kwargs):
                if not args or (name not in ("all_reduce", "broadcast") and len(args) < 2) or args[0] is None or \
                        (len(args) > 1 and args[1] is None and name not in ("all_reduce", "broadcast")):
                    # called by keywords, or with None: not watched (the ledger underneath says what is wrong)
                    return original(*args, async_op=async_op, **kwargs)
                sent = _sent(name, args)
                self.launches.append(Launch(time.perf_counter(), self.step, async_op, sum(t.numel() for t in sent),
                                            name, sum(t.numel() * t.element_size() for t in sent),
                                            {str(t.dtype).removeprefix("torch.") for t in sent}))
                if self.keep_sent:
                    self.launches[-1].sent = torch.cat([t.detach().reshape(-1) for t in sent]).clone()
                if not async_op:
                    return original(*args, **kwargs)
                outputs = _outputs(name, args)
                privates = [t.detach().clone() for t in outputs]
                first = privates if isinstance(args[0], (list, tuple)) else privates[0]
                if name not in ("all_reduce", "broadcast"):  # the output is not the input: NaN until the wait
                    with torch.no_grad():
                        for t in outputs:
                            if t.is_floating_point():
                                t.fill_(EARLY)
                delivery = _Delivery(outputs, privates, self)
                handle = HeldWork(original(first, *args[1:], async_op=True, **kwargs), delivery, self.step)
                self._handles.add(handle)
                return handle
            return collective

        wait_all, collect_all = torch.futures.wait_all, torch.futures.collect_all

        def waited_all(futures):
            self.waits.append(time.perf_counter())
            return wait_all(_unwrapped(futures))

        def collected_all(futures):  # one future for them all: waiting for it waits for each
            return WatchedFuture(collect_all(_unwrapped(futures)), self.waits)

        for name in WATCHED:
            setattr(dist, name, watched(name))
        for module, alias, name in aliases:
            setattr(module, alias, getattr(dist, name))
        torch.futures.wait_all, torch.futures.collect_all = waited_all, collected_all
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)
            for module, alias, name in aliases:
                setattr(module, alias, originals[name])
            torch.futures.wait_all, torch.futures.collect_all = wait_all, collect_all
