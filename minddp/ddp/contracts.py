"""The reducer's contracts: the slot of each part, the phase of its backward, the interface for policies.

:class:`~minddp.ddp.reducer.Reducer` holds one *part* per slot and calls it
at named steps of the path of a gradient; each slot is a ``Protocol`` here,
satisfied by the plain part in ``reducer.py`` and by the parts in
:mod:`minddp.ddp.parts`:

* :class:`Readiness`: when is a parameter's gradient ready for its bucket?
* :class:`GradientTransfer`: how a gradient gets into its bucket slot, and the average back into ``.grad``;
* :class:`Communication`: how a complete bucket travels (an all-reduce, a comm hook);
* :class:`Passenger`: what rides in the last bucket after the gradients (nothing, or the buffers);
* :class:`Observer`: what only watches (a tuple of them; none, no call).

:class:`BackwardPhase` is where the reducer is in a backward, one value
instead of several flags (as FSDP2's ``TrainingState``). :class:`Policy` is
what decides *above* the reducer (the learned bucket order,
``minddp_lab.auto.plan_buckets``, ZeRO stage 2): it is attached with
``Reducer.add_policy``, told at the end of every synchronized backward, and
drives the reducer only through the methods of the reducer's last section
("the interface for policies"); :class:`Rebuild` is what it still plans
for the buckets, which another policy may need to know.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn

# In the annotations below, ``Reducer`` is minddp.ddp.reducer.Reducer and ``Bucket`` minddp.ddp.buckets.Bucket,
# named and not imported: this module is below both (the reducer imports it), and annotations are not evaluated.

__all__ = ["BackwardPhase", "Readiness", "GradientTransfer", "Communication", "Passenger", "Observer", "Policy",
           "Rebuild"]


class BackwardPhase(enum.Enum):
    """Where the reducer is, from the end of a synchronized forward to the end of its backward.

    ::

        IDLE ──prepare_for_backward──> ARMED ──first hook──> REDUCING ──finish_backward──> IDLE
                                                               │  ^
                                       a nested pass ended,    v  │ the next hook
                                       buckets still to come  BETWEEN_PASSES

    A forward inside ``no_sync()`` (or without grad) leaves it IDLE: the
    hooks see IDLE and let the gradients accumulate.
    """

    IDLE = "idle"  # no averaging backward armed: hooks do nothing
    ARMED = "armed"  # a synchronized forward ended: its backward averages; no hook yet
    REDUCING = "reducing"  # hooks fire; the end-of-pass callback is queued on autograd's engine
    # [Note: nested passes] A reentrant activation checkpoint runs a backward
    # pass of its own inside a node of the outer one; its hooks come first,
    # and its end runs the queued callback. If buckets are still to come, the
    # backward is not over: the outer pass goes on, and its next hook queues
    # the callback again (BETWEEN_PASSES -> REDUCING), there.
    BETWEEN_PASSES = "between passes"

    @property
    def in_backward(self) -> bool:
        """Has this backward's first hook fired (and its end not yet come)?"""
        return self in (BackwardPhase.REDUCING, BackwardPhase.BETWEEN_PASSES)


class Readiness(Protocol):
    """When is a parameter ready? (plain: at its hook; ``find_unused_parameters``, ``static_graph``)"""

    used_on_some_rank: list[bool] | None  # per parameter, after a backward; None: every parameter had a gradient

    def prepare_for_backward(self, reducer: Reducer, output: Any) -> None:
        """After a synchronized forward, with its output."""

    def is_ready(self, reducer: Reducer, index: int) -> bool:
        """At ``params[index]``'s hook: count it ready now? (It may mark others ready: ``reducer.mark_ready``.)"""

    def backward_ending(self, reducer: Reducer) -> None:
        """Before the check that every bucket was launched."""

    def shadow_backward(self, reducer: Reducer) -> None:
        """A joined rank's stand-in for a backward, after the buckets: the same collectives as the others'."""


class GradientTransfer(Protocol):
    """How a gradient gets into its bucket slot and the average back into ``.grad``."""

    def buckets_built(self, reducer: Reducer) -> None:
        """The buckets were (re)built (``reducer.buckets``)."""

    def gradient_ready(self, bucket: Bucket, position: int, param: nn.Parameter) -> None:
        """``param`` (at ``position`` in ``bucket``) has its gradient (plain: nothing yet, the copy waits)."""

    def fill_bucket(self, bucket: Bucket, scale: float) -> None:
        """Every gradient of a complete bucket into its slot, times ``scale`` (1/N)."""

    def write_grads(self, bucket: Bucket, used: list[bool] | None) -> None:
        """The averages (the bucket has arrived) into ``.grad``; ``used``: ``Readiness.used_on_some_rank``."""


class Communication(Protocol):
    """How a complete bucket travels."""

    divides_first: bool  # does the reducer scale gradients by 1/N before? (False: the hook averages)
    comm_hook: tuple[Any, Callable] | None  # (state, hook) of a registered comm hook; None: none

    def communicate(self, bucket: Bucket) -> torch.futures.Future:
        """Start reducing ``bucket.buffer`` over the ranks; a future of the reduced buffer."""


class Passenger(Protocol):
    """What rides in the last bucket, ``numel`` elements after its gradients (``buffer_sync="with_gradients"``)."""

    numel: int

    def fits(self, bucket_dtype: torch.dtype) -> bool:
        """Can a bucket of this dtype carry it exactly?"""

    def pack(self, tail: torch.Tensor) -> None:
        """Into the bucket's tail, before it is sent."""

    def receive(self, tail: torch.Tensor) -> None:
        """From the bucket's tail, once it has arrived."""


@runtime_checkable
class Observer(Protocol):
    """What only watches the path: subclass it and override the events you need (``reducer.add_observer``)."""

    def forward_started(self) -> None: ...
    def forward_done(self) -> None: ...
    def backward_started(self) -> None: ...
    def gradient_ready(self, index: int, param: nn.Parameter) -> None: ...
    def bucket_filled(self, bucket: Bucket, scale: float) -> None: ...
    def bucket_launching(self, bucket: Bucket) -> None: ...
    def bucket_launched(self, bucket: Bucket) -> None: ...  # bucket.future: its communication
    def backward_ending(self) -> None: ...  # the end-of-backward wait begins
    def bucket_reduced(self, bucket: Bucket) -> None: ...  # its sum is in its buffer
    def grads_written(self, bucket: Bucket) -> None: ...
    def backward_done(self) -> None: ...


class Rebuild(enum.Enum):
    """What a policy still plans for the buckets (:meth:`Policy.pending_rebuild`)."""

    NONE = "the buckets stay as they are"
    ORDER_TO_LEARN = "the buckets are rebuilt once, in the order the first backward shows"  # the learned order
    PLANS_TO_TIME = "minddp_lab.auto.plan_buckets rebuilds MiniDDP's buckets after its first measured steps"


class Policy(Protocol):
    """What drives the reducer from above (``reducer.add_policy(policy)``; ``remove_policy`` to stop).

    It may add observers, rebuild the buckets (``rebuild``), change the
    communication, the gradient transfer and the bucket storage; it is told
    when a synchronized backward is over (a joined rank's stand-in for one
    too), and says what it still plans for the buckets.
    """

    def after_backward(self) -> None:
        """A synchronized backward is over (``.grad`` written), in the order the policies were added."""

    def pending_rebuild(self) -> Rebuild:
        """Will this policy still rebuild the buckets, and why?"""
