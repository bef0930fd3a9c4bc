"""Simulating a DDP step at any world size, from a trace of a real one.

Learn DDP on two CPU processes, then ask how the step would scale to 1,024
GPUs: this package answers with a replay, not a cluster.

* :mod:`minddp_lab.simulate.profile`: the compute profile of one step (forward,
  when each gradient was ready, sizes and dtypes), read from
  ``MiniDDP(..., trace=True)``'s Chrome trace;
* :mod:`minddp_lab.network` (one level up): the latency-bandwidth model of
  ring, tree and hierarchical all-reduce, with cited presets;
* :mod:`minddp_lab.simulate.replay`: DDP's policy (bucket caps, strict bucket
  order, one collective on the wire, compression, ``no_sync`` accumulation)
  replayed bucket by bucket: step time, exposed communication, hidden
  fraction, scaling efficiency;
* :mod:`minddp_lab.simulate.overheads`: the costs the bare replay misses (per
  step, per gradient hook, per bucket, compute lost to collectives beside
  backward), named, with a preset fitted to PyTorch's published DDP table;
* :mod:`minddp_lab.simulate.cluster`: your network from what you know (achieved
  bandwidth, GPUs and NICs per node, a measured ``all_reduce_perf`` table),
  and the presets at their achieved bandwidth with its source;
* :mod:`minddp_lab.simulate.record`: a trace of a ``minddp_lab.models`` model or of
  your own (``module:function``);
* :mod:`minddp_lab.simulate.report`: the table and the pictures;
* :mod:`minddp_lab.simulate.zero`: DDP against ZeRO stages 1, 2 and 3 at any
  world size, for a model given by its size: the paper's bytes per rank, the
  replay with reduce-scatters, the parameters' all-gather
  (``python -m minddp_lab.simulate zero``, :mod:`minddp_lab.simulate.zero_report`);
* :mod:`minddp_lab.simulate.stage3`: stage 3 unit by unit (all-gather before
  each unit's forward and backward, reduce-scatter after, prefetch on or
  off) and its working set;
* ``python -m minddp_lab.simulate``: the command (``--help``).

Nothing here needs a process group: a trace file is enough.
"""

from minddp_lab.simulate.profile import ComputeProfile, Gradient, load_profile, profile_from_trace
from minddp_lab.simulate.overheads import NO_OVERHEADS, OVERHEAD_PRESETS, Overheads
from minddp_lab.simulate.replay import DDPPolicy, SimulatedBucket, SimulatedStep, simulate_step

__all__ = [
    "ComputeProfile", "Gradient", "load_profile", "profile_from_trace",
    "DDPPolicy", "SimulatedBucket", "SimulatedStep", "simulate_step",
    "Overheads", "NO_OVERHEADS", "OVERHEAD_PRESETS",
]
