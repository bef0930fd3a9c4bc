"""Buckets in the order gradients really arrive, learned from the first backward (torch's DDP does this).

A guess at the order gradients come in (reverse registration: the last layer
registered is the first whose gradient is ready) breaks on a model that
registers its layers in another order than it runs them (a head defined
before the body, a module reused): a bucket then waits for one late
gradient while its others are long done, and launches late.

So, as torch's DDP since 2.14, the first backward sends all gradients in one
bucket (:func:`minddp.bucket_assignment.first_guess_buckets`), and the
buckets are then rebuilt once, in the order the gradients came. Every rank must build the same buckets (they
are what keeps collectives matched), so rank 0's order is broadcast and
everyone uses it. A policy on the reducer's hook points, like
``bucket_cap_mb="auto"`` (:mod:`minddp.bucket_planner`): it watches the
arrival log, is called at the end of the backward, and calls ``rebuild``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minddp.sync import global_rank

__all__ = ["LearnedBucketOrder"]


class LearnedBucketOrder:
    """Rebuild ``reducer``'s buckets once, after its first backward, in rank 0's arrival order, with its
    caps (until then, torch's first guess: one bucket). With ``static_graph`` after its second backward,
    as torch does: the first one only counts each parameter's hooks (:mod:`minddp.features.static_graph`)."""

    def __init__(self, reducer):
        self.reducer = reducer
        self.backwards_to_skip = 1 if reducer.options.static_graph else 0
        reducer.order_to_learn = True
        reducer.watch_arrivals(self)
        reducer.backward_done_callbacks.append(self.after_first_backward)

    def after_first_backward(self) -> None:
        if self.backwards_to_skip:  # the same on every rank: each takes part in the broadcast below
            self.backwards_to_skip -= 1
            return
        reducer = self.reducer
        reducer.watch_arrivals(self, on=False)
        reducer.backward_done_callbacks.remove(self.after_first_backward)
        arrived = list(dict.fromkeys(i for i, _ in reducer.arrival_log))
        seen = set(arrived)  # parameters that got no gradient keep the guess: reverse registration
        order = arrived + [i for i in reversed(range(len(reducer.params))) if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64, device=reducer.device)
        dist.broadcast(order_t, src=global_rank(reducer.process_group, 0), group=reducer.process_group)
        reducer.order_to_learn = False
        reducer.rebuild(order_t.tolist(), *reducer.caps)  # always: the caps change too (one bucket until now)
