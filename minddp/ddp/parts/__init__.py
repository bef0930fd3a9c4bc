"""Every option beyond the plain path, each a *part* chosen once by ``MiniDDP``'s constructor.

The plain path (``minddp/ddp/wrapper.py``, ``minddp/ddp/reducer.py``, ``minddp/ddp/buckets.py``)
is what a default ``MiniDDP(model)`` step runs: hook, bucket, in-order launch,
end-of-backward wait, ``.grad``. Where torch's DDP varies, the reducer holds
one part per slot, an object with its own state, and calls it at the named
step; the plain part of each slot lives in ``minddp/ddp/reducer.py``, the others
here, one file per option:

* readiness, when is a parameter ready (``prepare_for_backward``,
  ``is_ready``, ``backward_ending``, ``shadow_backward``):
  :mod:`~minddp.ddp.parts.unused_parameters`, :mod:`~minddp.ddp.parts.static_graph`;
* gradients, how a gradient gets into its bucket and back
  (``buckets_built``, ``gradient_ready``, ``fill_bucket``, ``write_grads``):
  ``MissingGradients`` in :mod:`~minddp.ddp.parts.unused_parameters`,
  :mod:`~minddp.ddp.parts.gradient_cases`, :mod:`~minddp.ddp.parts.bucket_views`,
  :mod:`~minddp.ddp.parts.lent_buckets` (around another);
* communication, how a bucket travels (``communicate``):
  :mod:`~minddp.ddp.parts.comm_hook`;
* what rides in the last bucket (the reducer's ``passenger``):
  :mod:`~minddp.ddp.parts.buffers_in_bucket`;
* observers, what only watches (:class:`minddp.ddp.reducer.Observer`):
  :mod:`~minddp.observe.follow` (and ``minddp/observe/trace.py``, the reducer's ``ArrivalLog``);
* the forward's parts (``MiniDDP.forward`` calls them):
  :mod:`~minddp.ddp.parts.replica_checks`, :mod:`~minddp.ddp.parts.uneven_inputs`,
  and the buffers' policy (:class:`minddp.ddp.broadcast.BufferSync`, or the passenger).

A part that is not chosen is never called; nothing changes a class at run
time. ``register_comm_hook``, ``join`` and ``follow`` swap or add one later,
through the reducer's ``set_communication``, ``set_passenger`` and
``add_observer``. A learner can skip any of these files whole;
``docs/reading_the_code.md`` lists them with the option that picks each.
"""
