"""The data-parallel wrappers of lessons 04 to 07b, one file per step, each built from the last.

Each file holds only its wrapper, so that ``diff`` between neighbours shows
one lesson's idea and nothing else (the lessons keep their experiments, the
mistaken variants and the notes they take for timelines)::

    04  hand_ddp.py    HandDDP     broadcast at start, all-reduce every .grad after backward
    05  hook_ddp.py    HookDDP     the same averaging, from a post-accumulate hook per parameter
    06  async_ddp.py   AsyncDDP    the hook launches the all-reduce and goes on; wait at the end
    07  bucket_ddp.py  BucketDDP   gradients packed into flat buckets, launched in order
    07b flat_ddp.py    FlatDDP     persistent buckets, divide first, end-of-backward callback,
                                   buffers broadcast, buckets rebuilt in arrival order

    diff lessons/wrappers/hook_ddp.py lessons/wrappers/async_ddp.py

Lesson 08's ``minddp.MiniDDP`` is ``FlatDDP`` grown up (lesson 08 prints the diff).
"""
