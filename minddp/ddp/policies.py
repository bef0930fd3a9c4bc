"""What acts on the reducer between backwards: the learned bucket order, ZeRO stage 2, a bucket planner.

The core (:mod:`minddp.ddp.core`) knows nothing of these. It names one event
for them, ``after_backward`` (a synchronized backward is over, ``.grad`` is
written, and no frame of the reducer holds a bucket), and offers what they
use: ``rebuild`` (new buckets at the next synchronized forward),
``set_communication``, ``set_gradients``, ``use_bucket_storage``,
``add_observer``. A :class:`Policy` is attached with :func:`add_policy`:
the policies of one reducer are one observer of it, :class:`Policies`, that
tells each in turn.

Policies may need to know each other's plans for the buckets (ZeRO stage 2
partitions gradients by them, so it must know whether they are final): each
says how many more backwards it will rebuild them for
(:meth:`Policy.backwards_until_final`), and :func:`backwards_until_buckets_final`
sums that up for one reducer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from minddp.ddp.core.slots import Observer

__all__ = ["Policy", "Policies", "add_policy", "remove_policy", "policies_of", "backwards_until_buckets_final", "ArrivalOrder",
           "LearnedBucketOrder"]


class Policy(ABC):
    """What drives a reducer from above, told at the end of every synchronized backward."""

    @abstractmethod
    def after_backward(self) -> None:
        """A synchronized backward is over (``.grad`` written), in the order the policies were added
        (a joined rank's stand-in for one too)."""

    @abstractmethod
    def backwards_until_final(self) -> int | None:
        """How many more synchronized backwards end with this policy rebuilding the buckets: 0, none;
        None, not known in advance (it decides from what it measures)."""


class Policies(Observer):
    """The policies of one reducer, as one observer: ``after_backward`` goes to each, in the order added."""

    def __init__(self):
        self.policies: tuple[Policy, ...] = ()

    def after_backward(self) -> None:
        for policy in self.policies:  # (a tuple: a policy may remove itself meanwhile)
            policy.after_backward()


def _policies_of(reducer) -> Policies | None:
    return next((o for o in reducer.observers if isinstance(o, Policies)), None)


def policies_of(reducer) -> tuple[Policy, ...]:
    """The policies attached to ``reducer``, in the order they were added."""
    policies = _policies_of(reducer)
    return policies.policies if policies else ()


def add_policy(reducer, policy: Policy) -> None:
    """Tell ``policy`` the end of every synchronized backward of ``reducer`` from now on."""
    policies = _policies_of(reducer)
    if policies is None:
        policies = Policies()
        reducer.add_observer(policies)
    if policy not in policies.policies:
        policies.policies += (policy,)


def remove_policy(reducer, policy: Policy) -> None:
    """Stop telling ``policy``; the last one gone, the reducer is back to its plain path."""
    policies = _policies_of(reducer)
    if policies is None:
        return
    policies.policies = tuple(p for p in policies.policies if p is not policy)
    if not policies.policies:
        reducer.remove_observer(policies)


def backwards_until_buckets_final(reducer) -> int | None:
    """How many more synchronized backwards end with some policy rebuilding ``reducer``'s buckets
    (0: they are final now; None: a policy does not know yet)."""
    policies = _policies_of(reducer)
    counts = [policy.backwards_until_final() for policy in (policies.policies if policies else ())]
    if None in counts:
        return None
    return max(counts, default=0)


class ArrivalOrder(Observer):
    """Which gradients came, in order, in the last backward (``indices``)."""

    def __init__(self):
        self.indices: list[int] = []

    def backward_started(self) -> None:
        self.indices = []  # only this backward's order counts (an earlier one may have failed)

    def gradient_ready(self, index: int, param) -> None:
        self.indices.append(index)


class LearnedBucketOrder(Policy):
    """Buckets in the order gradients really arrive (torch's DDP does this since 2.14).

    A guess at the order gradients come in (reverse registration: the last
    layer registered is the first whose gradient is ready) breaks on a model
    that registers its layers in another order than it runs them (a head
    defined before the body, a module reused): a bucket then waits for one late
    gradient while its others are long done, and launches late. So the first
    backward sends all gradients in one bucket (the core's first guess), and
    the buckets are rebuilt once, in the order the gradients came, at the next
    synchronized forward. Every rank must build the same buckets (they are what
    keeps collectives matched), so rank 0's order is broadcast and everyone
    uses it. With ``static_graph`` after its second backward, as torch does: the
    first one only counts each parameter's hooks
    (:mod:`minddp.ddp.parts.static_graph`).

    While it learns, an :class:`ArrivalOrder` watches the gradients come; once
    it has rebuilt, both detach, and the reducer is back to its plain path.
    """

    def __init__(self, reducer):
        self.reducer = reducer
        self.backwards_to_skip = 1 if reducer.options.static_graph else 0
        self.learned = False
        self.arrivals = ArrivalOrder()
        reducer.add_observer(self.arrivals)
        add_policy(reducer, self)

    def backwards_until_final(self) -> int:
        return 0 if self.learned else 1 + self.backwards_to_skip

    def after_backward(self) -> None:
        if self.backwards_to_skip:  # the same on every rank: each takes part in the broadcast below
            self.backwards_to_skip -= 1
            return
        reducer = self.reducer
        reducer.remove_observer(self.arrivals)
        remove_policy(reducer, self)
        arrived = list(dict.fromkeys(self.arrivals.indices))
        seen = set(arrived)  # parameters that got no gradient keep the guess: reverse registration
        order = arrived + [i for i in reversed(range(len(reducer.params))) if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64, device=reducer.device)
        rank0 = dist.get_process_group_ranks(reducer.process_group)[0]  # a global rank, as broadcast wants
        dist.broadcast(order_t, src=rank0, group=reducer.process_group)
        self.learned = True
        reducer.rebuild(order_t.tolist(), *reducer.caps)  # always: the caps change too (one bucket until now)
