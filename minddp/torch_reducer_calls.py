"""The methods of torch's ``Reducer`` that frameworks call from outside (``docs/frameworks.md``).

accelerate and Lightning reach into ``ddp.reducer`` for a few private
methods of torch's C++ reducer. MiniDDP's reducer answers them with the
same effect, or refuses with an error naming the call; a framework that
calls one expecting work done must never get a silent nothing.
(``prepare_for_backward``, which arms the next backward, is on the plain
path itself: :class:`minddp.reducer.Reducer`.)
"""

from __future__ import annotations

__all__ = ["TorchReducerCalls"]


class TorchReducerCalls:
    """A base class of :class:`~minddp.reducer.Reducer`: methods only, on the reducer's own state."""

    def _rebuild_buckets(self) -> bool:
        """torch's: rebuild the buckets now if a rebuild is due, and say whether it did; first, refuse if
        the previous backward started reducing and never finished (Lightning calls it before each manual
        backward). MiniDDP rebuilds at the end of the backward that showed the order
        (:mod:`minddp.bucket_order`), so none is ever due before a forward or a backward: False."""
        if self.backward_started:
            raise self._missing_gradients_error()
        return False

    def _delay_all_reduce(self) -> None:
        """torch's static-graph first step: reduce every bucket at the end of the first backward (Lightning
        calls it after a manual backward with ``static_graph=True``). MiniDDP's ``static_graph`` does
        exactly that at the end of its first backward (:mod:`minddp.features.static_graph`): afterwards
        there is nothing left to reduce. Anything else is refused."""
        first_backward_done = getattr(self, "_hooks_expected", None) is not None  # set by StaticGraph
        if not self.options.static_graph or not first_backward_done or self.backward_started:
            raise RuntimeError(
                "MiniDDP's reducer._delay_all_reduce(): only after the first backward of a model constructed "
                "with static_graph=True (whose gradients MiniDDP has then reduced already); here "
                f"static_graph={self.options.static_graph}, {self.backwards_done} backward(s) done")
