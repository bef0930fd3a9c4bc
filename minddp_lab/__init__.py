"""minddp_lab: the lab beside the library. It imports :mod:`minddp`; :mod:`minddp` never imports it.

``import minddp`` gives what a researcher trains with (MiniDDP, the sampler,
SyncBatchNorm, ZeRO, FSDP, launching). What measures, predicts and teaches
around it lives here:

* :mod:`~minddp_lab.network`: a network's figures (latency, bandwidth, GPUs
  and NICs per node) and the alpha-beta model of its collectives, the
  simulator's and the planner's;
* :mod:`~minddp_lab.simulated_link`: a link's delay added in the process;
* :mod:`~minddp_lab.trace_view`: MiniDDP's Chrome trace read back, and its overlap drawn;
* :mod:`~minddp_lab.links`: real links between network namespaces, shaped to
  a rate (``minddp_lab.links.spawn(..., link="1gbit")``), and the link probe;
* :mod:`~minddp_lab.simulate`: a DDP step replayed at any world size
  (``python -m minddp_lab.simulate``);
* :mod:`~minddp_lab.auto`: buckets chosen for the measured link and the first
  steps' profile (:func:`minddp_lab.auto.plan_buckets`);
* :mod:`~minddp_lab.train`: the ``minddp-train`` program;
* :mod:`~minddp_lab.models`, :mod:`~minddp_lab.data`: the examples' models
  and MNIST (torchvision);
* :mod:`~minddp_lab.rank_pool`: live ranks that run one function after
  another (the tests' harness).
"""
