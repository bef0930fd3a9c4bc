"""The methods of torch's ``Reducer`` that frameworks call from outside (``docs/frameworks.md``).

accelerate and Lightning reach into ``ddp.reducer`` for a few private
methods of torch's C++ reducer. MiniDDP's reducer answers them with the
same effect, or refuses with an error naming the call; a framework that
calls one expecting work done must never get a silent nothing. None is on
the path of a gradient, so they live here, and
:class:`~minddp.ddp.reducer.Reducer` names each as one of its methods.
(``prepare_for_backward``, which arms the next backward, is on the plain
path itself.)
"""

from __future__ import annotations

__all__ = ["rebuild_buckets", "delay_all_reduce"]


def rebuild_buckets(reducer) -> bool:
    """``reducer._rebuild_buckets()``, torch's: rebuild the buckets now if a rebuild is due, and say whether
    it did (True once, after the backward that showed the order, as torch's); first, refuse if the previous
    backward started reducing and never finished (Lightning calls it before each manual backward)."""
    if reducer.backward_started:
        raise reducer._missing_gradients_error()
    return reducer.rebuild_if_due()


def delay_all_reduce(reducer) -> None:
    """``reducer._delay_all_reduce()``, torch's static-graph first step: reduce every bucket at the end of
    the first backward (Lightning calls it after a manual backward with ``static_graph=True``). MiniDDP's
    ``static_graph`` does exactly that at the end of its first backward (:mod:`minddp.ddp.parts.static_graph`):
    afterwards there is nothing left to reduce. Anything else is refused."""
    if not reducer.options.static_graph or not reducer.backwards_done or reducer.backward_started:
        raise RuntimeError(
            "MiniDDP's reducer._delay_all_reduce(): only after the first backward of a model constructed "
            "with static_graph=True (whose gradients MiniDDP has then reduced already); here "
            f"static_graph={reducer.options.static_graph}, {reducer.backwards_done} backward(s) done")
