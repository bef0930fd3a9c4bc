"""Every option beyond the plain path, each a *part* chosen once by ``MiniDDP``'s constructor.

The plain path (``minddp/ddp/wrapper.py`` and ``minddp/ddp/core/``) is what a
default ``MiniDDP(model)`` step runs: hook, bucket, in-order launch,
end-of-backward wait, ``.grad``. Where torch's DDP varies, the reducer holds
one part per slot, an object with its own state, and calls it at the named
step. Each slot is an abstract base class of :mod:`minddp.ddp.core.slots`;
the plain part of each lives in ``minddp/ddp/core/reducer.py``, the others
here, one file per option, each readable alone:

* readiness (``Readiness``), when is a parameter ready (``prepare_for_backward``,
  ``is_ready``, ``backward_ending``, ``shadow_backward``):
  :mod:`~minddp.ddp.parts.unused_parameters`, :mod:`~minddp.ddp.parts.static_graph`;
* gradients (``GradientTransfer``), how a gradient gets into its bucket and back
  (``buckets_built``, ``gradient_ready``, ``fill_bucket``, ``write_grads``):
  :mod:`~minddp.ddp.parts.gradient_cases` (missing, sparse, already in its slot),
  :mod:`~minddp.ddp.parts.bucket_views` (holds a ``GradientCases``), and two around
  another: :mod:`~minddp.ddp.parts.lent_buckets` and
  :mod:`~minddp.ddp.parts.buffers_in_bucket` (the buffers ride in the last bucket);
* communication (``Communication``), how a bucket travels (``communicate``):
  :mod:`~minddp.ddp.parts.comm_hook`;
* observers, told the events of the path (``Observer``): in :mod:`minddp.ddp.observers`,
  and the policies, which act between backwards (:mod:`minddp.ddp.policies`);
* the forward's parts (``MiniDDP.forward`` calls them):
  :mod:`~minddp.ddp.parts.replica_checks`, :mod:`~minddp.ddp.parts.uneven_inputs`,
  and the buffers' policy (:class:`minddp.ddp.broadcast.BufferSync`, or the buffers in the last bucket).

A part that is not chosen is never called; nothing changes a class at run
time. ``register_comm_hook``, ``join`` and ``follow`` swap or add one later,
through the reducer's ``set_communication``, ``set_gradients`` and
``add_observer``. A learner can skip any of these files whole;
``docs/reading_the_code.md`` lists them with the option that picks each.
"""
