"""A slow network on a laptop: all-reduces that take as long as a real link would.

On one machine Gloo's "network" is loopback memory copies: a message costs
microseconds, so the trade-offs that shape DDP (per-call latency against
lost overlap, bucket sizes, compression) never show. :class:`SimulatedLink`
puts them back. It does the real all-reduce -- results stay exact -- and
hands the result over no earlier than the network model of
:mod:`minddp_lab.network` says::

    duration = allreduce_time(nbytes, world_size, link)
             = 2 (p - 1) alpha + 2 (p - 1) / p * nbytes / bandwidth   (ring)

One message is on the "wire" at a time: a collective starts when it is
launched or when the previous one has finished, whichever is later, as
collectives on one process group do. The waiting happens on a small worker
thread, never on the caller's: a launch returns at once, so autograd goes on
computing while a bucket is "in flight", exactly the overlap DDP relies on.

Two ways in::

    link = SimulatedLink("laptop")            # a preset of minddp_lab.network.PRESETS
    fut = link.all_reduce(tensor)             # the sum, as a Future[Tensor]

    ddp.register_comm_hook(link, simulated_allreduce_hook)   # torch's contract,
                                                             # MiniDDP or torch's DDP

ZeRO's and FSDP's two halves of an all-reduce travel the same way:
``link.all_gather(output, input)`` and ``link.reduce_scatter(output, input)``,
each costing the model's ring half (``(p - 1) alpha + (p - 1) / p * nbytes /
bandwidth`` over the whole buffer), on the same one-at-a-time wire.

Every message is recorded in ``link.messages`` (its kind, bytes, when it was
launched, when the wire took it, when it completed), so a lesson can draw it.
Completion is never *earlier* than the model says; it can be later, when the
real all-reduce or the machine is slower than the simulated link.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minddp_lab.network import Link, allreduce_time, collective_time, get_link

__all__ = ["Message", "SimulatedLink", "simulated_allreduce_hook"]

# The two halves are bound when this module is imported, so that a caller may wrap torch.distributed's own
# names afterwards (lesson 22 routes minddp.fsdp's collectives through a link) without the link calling itself.
# torch 2.14 renamed the two halves (the old names warn); either name is the same collective.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Message:
    """One all-reduce on the simulated wire; times from ``time.perf_counter()``."""

    nbytes: int
    predicted_s: float  # what the network model says it takes on the wire
    launched: float  # when the caller launched it
    started: float | None = None  # when the wire was free for it
    finished: float | None = None  # when its future was completed
    kind: str = "all_reduce"  # or "all_gather", "reduce_scatter"


class SimulatedLink:
    """Complete each all-reduce after the time ``link`` predicts, one at a time.

    ``link`` is a :class:`~minddp_lab.network.Link` or the name of a preset
    (``"laptop"``: 2 ms per message, 200 MB/s). ``algorithm`` is ``"ring"``
    or ``"tree"`` (see :func:`minddp_lab.network.allreduce_time`).
    """

    def __init__(self, link: Link | str = "laptop", *, algorithm: str = "ring",
                 process_group: dist.ProcessGroup | None = None):
        self.link = get_link(link) if isinstance(link, str) else link
        self.algorithm = algorithm
        self.process_group = process_group
        self.messages: list[Message] = []
        self._queue: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None

    def predicted_time(self, nbytes: int, world_size: int | None = None) -> float:
        """Seconds one all-reduce of ``nbytes`` occupies the wire."""
        if world_size is None:
            world_size = dist.get_world_size(self.process_group)
        return allreduce_time(nbytes, world_size, self.link, self.algorithm)

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Sum ``tensor`` over the group in place; the future yields it when the wire is done."""
        message = Message(tensor.nbytes, self.predicted_time(tensor.nbytes), time.perf_counter())
        return self._launch(message, dist.all_reduce(tensor, group=self.process_group, async_op=True), tensor)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.futures.Future:
        """Every rank's ``input`` laid end to end in ``output``; the future yields ``output``."""
        work = _ALL_GATHER(output, input, group=self.process_group, async_op=True)
        return self._launch(self._half("all_gather", output.nbytes), work, output)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> torch.futures.Future:
        """This rank's 1/N of the sum of every rank's ``input``, into ``output``; the future yields it."""
        work = _REDUCE_SCATTER(output, input, group=self.process_group, async_op=True)
        return self._launch(self._half("reduce_scatter", input.nbytes), work, output)

    def _half(self, kind: str, nbytes: int) -> Message:
        seconds = collective_time(kind, nbytes, dist.get_world_size(self.process_group), self.link)
        return Message(nbytes, seconds, time.perf_counter(), kind=kind)

    def _launch(self, message: Message, work, result: torch.Tensor) -> torch.futures.Future:
        self.messages.append(message)
        future: torch.futures.Future = torch.futures.Future()
        if self._worker is None:
            self._worker = threading.Thread(target=self._deliver, name="simulated-link", daemon=True)
            self._worker.start()
        self._queue.put((message, work, result, future))
        return future

    def _deliver(self) -> None:
        # First in, first out: the wire carries one message at a time, in
        # launch order, so finishing times come out in that order too.
        wire_free_at = 0.0
        while True:
            message, work, tensor, future = self._queue.get()
            message.started = max(message.launched, wire_free_at)
            try:
                work.wait()  # the real sum (on loopback, much faster than the model)
            except Exception as error:  # a peer died or timed out: the caller sees it
                message.finished = time.perf_counter()
                wire_free_at = message.finished
                future.set_exception(error)
                continue
            delay = message.started + message.predicted_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            message.finished = wire_free_at = time.perf_counter()
            future.set_result(tensor)

    def wire_time(self) -> float:
        """Seconds the recorded messages occupied the wire, by the model."""
        return sum(m.predicted_s for m in self.messages)


def simulated_allreduce_hook(link: SimulatedLink, bucket) -> torch.futures.Future:
    """A communication hook: the exact average, delivered at the simulated link's pace.

    ``bucket`` is a GradBucket (MiniDDP's or torch's): its buffer holds this
    rank's gradients, not yet divided by the world size.
    """
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(link.process_group))
    return link.all_reduce(buffer)
