"""The data-parallel wrappers of lessons 04 to 07b and the reducers of 07c, one file per step, each built from the last.

Each file holds only its wrapper, so that ``diff`` between neighbours shows
one lesson's idea and nothing else (the lessons keep their experiments, the
mistaken variants and the notes they take for timelines)::

    04  hand_ddp.py          HandDDP          broadcast at start, all-reduce every .grad after backward
    05  hook_ddp.py          HookDDP          the same averaging, from a post-accumulate hook per parameter
    06  async_ddp.py         AsyncDDP         the hook launches the all-reduce and goes on; wait at the end
    07  bucket_ddp.py        BucketDDP        gradients packed into flat buckets, launched in order
    07b flat_ddp.py          FlatDDP          persistent buckets, divide first, end-of-backward callback,
                                              buffers broadcast, buckets rebuilt in arrival order
    07c split_reducer.py     SplitReducer     the gradient's path as a class apart from the module
        assigned_reducer.py  AssignedReducer  buckets assigned as torch assigns them
        bucketed_reducer.py  BucketedReducer  the library's Bucket objects
        counted_reducer.py   CountedReducer   hooks that count; one batched copy per complete bucket
        phased_reducer.py    PhasedReducer    where a backward is, as one BackwardPhase
        nested_reducer.py    NestedReducer    nested passes; errors that name the parameter
        weak_reducer.py      WeakReducer      hooks that do not keep the reducer alive
        slotted_reducer.py   SlottedReducer   a part per slot: readiness, gradients, communication
        observed_reducer.py  ObservedReducer  every event told to one observer; buckets rebuilt
    08  minddp/ddp/core/reducer.py  Reducer   the library's: buckets given whole, the setters parts use

    diff lessons/wrappers/hook_ddp.py lessons/wrappers/async_ddp.py
    diff lessons/wrappers/observed_reducer.py minddp/ddp/core/reducer.py

From 07c on the module side stays in ``reducing_module.py`` (``ReducingModule``),
as ``minddp.MiniDDP`` (the module) stays apart from its reducer.
"""
