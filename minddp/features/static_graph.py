"""``static_graph=True``: every iteration uses the same parameters the same number of times.

The first backward only counts each parameter's gradient hooks and reduces
everything at its end (a parameter that got none counts as zero, now and
always); later backwards mark a parameter ready at its *last* expected
hook. This is what lets a block run twice under a reentrant activation
checkpoint (two nested passes, two hooks). Which parameters some rank uses
is learned once, with the first backward. A graph that changes after all is
an error, in torch's words.
"""

from __future__ import annotations

from minddp.features import Layer
from minddp.features.gradient_cases import GradientCases

__all__ = ["StaticGraph"]


class StaticGraph(Layer):
    height = 35

    def attach(self, find_unused: bool = False) -> None:
        self.add_layer(GradientCases)
        self._find_unused = find_unused
        self._hooks_seen = [0] * len(self.params)  # this backward, per parameter
        self._hooks_expected: list[int] | None = None  # learned by the first backward
        self._static_used: list[bool] | None = None  # ... and which parameters some rank uses
        self.unused = []  # parameters with no hook in the first backward

    def start_backward(self) -> None:
        super().start_backward()
        self._hooks_seen = [0] * len(self.params)
        for p in self.unused:  # no gradient will come for these: count them now
            self._mark_ready(self._index[p])

    def on_grad_ready(self, index: int, param) -> None:
        self._hooks_seen[index] += 1
        if self._hooks_expected is None:
            return  # the first backward: count only, reduce everything at its end
        if self._hooks_seen[index] > self._hooks_expected[index]:
            raise RuntimeError(
                f"MiniDDP(static_graph=True): Your training graph has changed in this iteration: parameter "
                f"{self.names[index]!r} got gradient {self._hooks_seen[index]} time(s), where the first "
                f"iteration gave it {self._hooks_expected[index]} (e.g. a parameter unused in the first "
                "iteration is used now). This is not compatible with static_graph set to True: construct "
                "MiniDDP(..., find_unused_parameters=True) without static_graph for a graph that changes.")
        if self._hooks_seen[index] == self._hooks_expected[index]:
            super().on_grad_ready(index, param)  # its last hook: the gradient is complete

    def finish_backward(self) -> None:
        if self._hooks_expected is None:  # now we know how many hooks each parameter gets
            self._hooks_expected = list(self._hooks_seen)
            self.unused = [p for p, n in zip(self.params, self._hooks_expected) if n == 0]
            self._mark_all_unready()
        elif self._find_unused:
            self._mark_all_unready()
        if self._next_to_launch < len(self.buckets):
            missing = self.abandon_unfinished_backward()
            raise RuntimeError(
                "MiniDDP(static_graph=True): Expected to have finished reduction in the prior iteration "
                "before starting a new one. This error indicates that your training graph has changed in "
                "this iteration, e.g., one parameter is used in first iteration, but then got unused in the "
                "second iteration. this is not compatible with static_graph set to True.\n"
                f"Parameters which did not receive grad: {missing}")
        self.globally_used = self._learned_use()
        super().finish_backward()

    def _learned_use(self) -> list[bool]:
        if self._static_used is None:  # learned once, by the first backward; the graph does not change
            self._static_used = self._used_on_any_rank([n > 0 for n in self._hooks_expected or self._hooks_seen])
        return self._static_used

    def shadow_backward_extras(self) -> None:
        """A joined rank's stand-in for the first backward: it saw no hook, and says so."""
        if self._static_used is None:
            self._hooks_seen = [0] * len(self.params)
            self.globally_used = self._learned_use()
