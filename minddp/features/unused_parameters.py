"""``find_unused_parameters=True``: parameters that get no gradient on some rank count as zero there.

Without it, a parameter the forward did not use never fires its hook, its
bucket never completes, and the plain path stops at the end of backward
with an error naming it. With it, as in torch's DDP:

* after each synchronized forward, the autograd graph of the output is
  walked (:func:`minddp.sync.params_reached_from`); a parameter it does not
  reach will get no gradient, so it is counted ready (zeros) as the
  backward starts, and its bucket need not wait for it;
* at the end of backward, a parameter reached but still without a gradient
  (an output left out of the loss) counts as zero too, in bucket order;
* one small all-reduce tells which parameters had a gradient on *some*
  rank: those get the average, the others keep their ``.grad`` (None stays None).
  With ``skip_all_reduce_unused_params`` (a promise that the unused ones stay
  the same on every rank) it is done at the first backward only.
"""

from __future__ import annotations

from typing import Any

import torch

from minddp.features import Layer
from minddp.features.gradient_cases import GradientCases
from minddp.sync import params_reached_from

__all__ = ["UnusedParameters"]


class UnusedParameters(Layer):
    height = 30

    def attach(self) -> None:
        self.add_layer(GradientCases)
        self.unused = []  # no gradient will come for these in this backward (the graph walk)

    def prepare_for_backward(self, output: Any) -> None:
        with torch.autograd.profiler.record_function("minddp.search_unused_parameters"):  # torch's name for it
            reached = params_reached_from(output)
        self.unused = [p for p in self.params if id(p) not in reached]
        super().prepare_for_backward(output)

    def start_backward(self) -> None:
        super().start_backward()
        for p in self.unused:  # no gradient will come for these: count them now
            self._mark_ready(self._index[p])

    def finish_backward(self) -> None:
        self._mark_all_unready()  # reached by the walk, but no gradient came: zero as well
        if not (self.options.skip_all_reduce_unused_params and self.globally_used is not None):
            self.globally_used = self._used_on_any_rank(self._locally_used)
        # (skip_all_reduce_unused_params: promised the same parameters unused on every rank, every step)
        super().finish_backward()

    def shadow_backward_extras(self) -> None:
        """A joined rank's stand-in: it used nothing, and says so in the same all-reduce."""
        if not (self.options.skip_all_reduce_unused_params and self.globally_used is not None):
            self.globally_used = self._used_on_any_rank([False] * len(self.params))
