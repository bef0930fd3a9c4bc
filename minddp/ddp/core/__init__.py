"""The plain path of a gradient, in a room of its own: what a default ``MiniDDP(model)`` step runs.

Read it alone, top to bottom: it imports torch and itself, nothing else of
minddp. :mod:`~minddp.ddp.core.reducer` (the path: hook, count, fill times
1/N, launch strictly in bucket order, end of the outer pass, wait,
``.grad``) -> :mod:`~minddp.ddp.core.slots` (what it asks of each part, and
the events it tells) -> :mod:`~minddp.ddp.core.buckets` (one flat bucket and
its life cycle) -> :mod:`~minddp.ddp.core.assignment` (which parameters share
a bucket) -> :mod:`~minddp.ddp.core.weak_hooks` (hooks that do not keep the
model alive), and :mod:`~minddp.ddp.core.messages` (the words of its errors).
Lesson 07c arrives here: ``diff lessons/wrappers/observed_reducer.py
minddp/ddp/core/reducer.py``.
"""
