"""Every feature beyond the plain path, each a *layer* on :class:`minddp.reducer.Reducer`.

The plain path (``minddp/ddp.py``, ``minddp/reducer.py``, ``minddp/buckets.py``)
is what a default ``MiniDDP(model)`` step runs: hook, bucket, in-order launch,
end-of-backward wait, ``.grad``. Everything torch's DDP does beyond that lives
here, one file per feature, in one pattern:

* a layer is a class that overrides some of the reducer's named steps
  (``prepare_for_forward``, ``prepare_for_backward``, ``start_backward``,
  ``on_grad_ready``, ``bucket_ready``, ``fill_bucket``, ``communicate``,
  ``finish_backward``, ``write_grads``, ``_make_bucket``, ``bucket_dtype``)
  and calls ``super()`` to go on down the path;
* ``reducer.add_layer(Layer, **settings)`` stacks it (``attach`` sets up its
  state on the reducer), ``reducer.remove_layer(Layer)`` takes it off; the
  reducer's class is then the plain ``Reducer`` with these layers above it,
  ordered by their ``height`` (higher runs first);
* a feature that is off is not in the stack: the plain path neither calls
  nor tests for it.

A learner can skip any of these files whole. ``docs/reading_the_code.md``
lists them with the lesson that explains each.
"""

from __future__ import annotations

__all__ = ["Layer"]


class Layer:
    """Base of the layers. Subclasses override reducer steps; ``self`` is the reducer."""

    height = 0  # where it sits in the stack: a higher layer runs first, and calls down to lower ones

    def attach(self, **settings) -> None:
        """Set up this layer's state on the reducer (``self``) as it is stacked."""

    def detach(self) -> None:
        """Undo what :meth:`attach` set up that would matter once the layer is gone."""

    def shadow_backward_extras(self) -> None:
        """A joined rank's stand-in for a backward (:mod:`minddp.features.uneven_inputs`): what a
        layer communicates beyond the buckets (the unused-parameter search does: one all-reduce)."""
