"""Follow one gradient down the path: ``followed = model.follow("0.weight")``.

Stacks a layer that notes, for that parameter only, each station of the
plain path in the next synchronized backwards, with the time and the first
few values: the gradient at its hook, the same values times 1/N in its slot
of the bucket, the bucket's launch, the sum that came back into the slot
(once the end of backward waited for it), and the ``.grad`` written from it. Every rank
keeps its own record (``followed.report()``): the hook's values differ
between ranks, the sum and ``.grad`` do not. ``followed.stop()`` takes the
layer off again. Lesson 08 uses it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from minddp.features import Layer

__all__ = ["Follow", "FollowedGradient"]

SHOWN = 3  # values shown per station


class FollowedGradient:
    """The stations one parameter's gradient passed in the last synchronized backward."""

    def __init__(self, reducer, index: int):
        self.reducer, self.index, self.name = reducer, index, reducer.names[index]
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
        """Stop following (the layer comes off with the last followed gradient)."""
        self.reducer._followed.pop(self.index, None)
        if not self.reducer._followed:
            self.reducer.remove_layer(Follow)


class Follow(Layer):
    height = 60

    def attach(self) -> None:
        self._followed: dict[int, FollowedGradient] = {}

    def follow(self, index: int) -> FollowedGradient:
        followed = self._followed[index] = FollowedGradient(self, index)
        return followed

    def _here(self, bucket) -> list[tuple[FollowedGradient, int]]:
        """The followed gradients in ``bucket``, with their position in it."""
        return [(f, self._plan[f.index][1]) for f in self._followed.values() if self._plan[f.index][0] is bucket]

    def start_backward(self) -> None:
        for followed in self._followed.values():
            followed.stations = []
        super().start_backward()

    def on_grad_ready(self, index: int, param) -> None:
        followed = self._followed.get(index)
        if followed is not None:
            followed.note("hook", f"p.grad on rank {dist.get_rank(self.process_group)}", param.grad)
        super().on_grad_ready(index, param)

    def fill_bucket(self, bucket) -> None:
        super().fill_bucket(bucket)
        for followed, position in self._here(bucket):
            start = sum(p.numel() for p in bucket.params[:position])
            end = start + bucket.params[position].numel()
            followed.note("slot", f"bucket {bucket.index}[{start}:{end}] of {bucket.numel}, times "
                                  f"{self.scale:g}", bucket.views[position])

    def communicate(self, bucket) -> torch.futures.Future:
        future = super().communicate(bucket)
        for followed, _ in self._here(bucket):
            followed.note("launch", f"bucket {bucket.index}: async all-reduce of {bucket.buffer.nbytes} bytes")
        return future

    def write_grads(self, bucket) -> None:
        here = self._here(bucket)
        if here:
            bucket.wait()
            for followed, position in here:
                followed.note("waited", "its slot now holds the sum over ranks", bucket.views[position])
        super().write_grads(bucket)
        for followed, _ in here:
            followed.note(".grad", "written", self.params[followed.index].grad)
