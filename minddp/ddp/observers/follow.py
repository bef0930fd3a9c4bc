"""Follow one gradient down the path: ``followed = model.follow("0.weight")``.

Adds an observer (:class:`Follow`, one per reducer) that notes, for that
parameter only, each station of the plain path in the next synchronized
backwards, with the time and the first few values: the gradient at its
hook, the same values times 1/N in its slot of the bucket, the bucket's
launch, the sum that came back into the slot (once the end of backward
waited for it), and the ``.grad`` written from it. Every rank keeps its own
record (``followed.report()``): the hook's values differ between ranks, the
sum and ``.grad`` do not. ``followed.stop()`` takes the observer off again
with the last followed gradient. Lesson 08 uses it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from minddp.ddp.core.slots import Observer

__all__ = ["Follow", "FollowedGradient", "follow"]

SHOWN = 3  # values shown per station


class FollowedGradient:
    """The stations one parameter's gradient passed in the last synchronized backward."""

    def __init__(self, observer: "Follow", index: int):
        self.observer, self.index, self.name = observer, index, observer.reducer.names[index]
        self.stations: list[tuple[float, str, str, list[float] | None]] = []  # (time, station, what, values)

    def note(self, station: str, what: str = "", values: torch.Tensor | None = None) -> None:
        shown = None if values is None else values.detach().reshape(-1)[:SHOWN].double().tolist()
        self.stations.append((time.perf_counter(), station, what, shown))

    def report(self) -> str:
        """One line per station, times in ms from the hook."""
        stations = self.stations
        if not stations:
            return f"{self.name}: no synchronized backward since follow()"
        t0, lines = stations[0][0], []
        for when, station, what, values in stations:
            shown = "" if values is None else "[" + ", ".join(f"{v:+.5f}" for v in values) + ", ...]"
            lines.append(f"{(when - t0) * 1e3:8.3f} ms  {station:<10} {what} {shown}".rstrip())
        return "\n".join(lines)

    def stop(self) -> None:
        """Stop following (the observer comes off with the last followed gradient)."""
        self.observer.followed.pop(self.index, None)
        if not self.observer.followed:
            self.observer.reducer.remove_observer(self.observer)


def follow(reducer, name: str) -> FollowedGradient:
    """Follow the gradient of the parameter called ``name`` (MiniDDP's name, ``module.`` first, or the module's)."""
    names = reducer.names
    index = names.index(name) if name in names else names.index(name[7:]) if name[7:] in names else None
    if index is None:
        raise ValueError(f"MiniDDP.follow: no parameter named {name!r} with a gradient to follow; "
                         f"the module's are {names}")
    observer = next((o for o in reducer.observers if isinstance(o, Follow)), None) or Follow(reducer)
    reducer.add_observer(observer)
    followed = observer.followed[index] = FollowedGradient(observer, index)
    return followed


class Follow(Observer):
    """The observer behind :func:`follow`: the stations of the followed gradients."""

    def __init__(self, reducer):
        self.reducer = reducer
        self.followed: dict[int, FollowedGradient] = {}
        self.rank = dist.get_rank(reducer.process_group)

    def _here(self, bucket) -> list[tuple[FollowedGradient, int]]:
        """The followed gradients in ``bucket``, with their position in it."""
        return [(f, bucket.indices.index(f.index)) for f in self.followed.values() if f.index in bucket.indices]

    def backward_started(self) -> None:
        for followed in self.followed.values():
            followed.stations = []

    def gradient_ready(self, index: int, param) -> None:
        followed = self.followed.get(index)
        if followed is not None:
            followed.note("hook", f"p.grad on rank {self.rank}", param.grad)

    def bucket_filled(self, bucket, scale: float) -> None:
        for followed, position in self._here(bucket):
            start = sum(p.numel() for p in bucket.params[:position])
            end = start + bucket.params[position].numel()
            followed.note("slot", f"bucket {bucket.index}[{start}:{end}] of {bucket.numel}, times {scale:g}",
                          bucket.views[position])

    def bucket_launched(self, bucket) -> None:
        for followed, _ in self._here(bucket):
            followed.note("launch", f"bucket {bucket.index}: async all-reduce of {bucket.buffer.nbytes} bytes")

    def bucket_reduced(self, bucket) -> None:
        for followed, position in self._here(bucket):
            followed.note("waited", "its slot now holds the sum over ranks", bucket.views[position])

    def grads_written(self, bucket) -> None:
        for followed, _ in self._here(bucket):
            followed.note(".grad", "written", self.reducer.params[followed.index].grad)


