"""The exercises the grader knows: number, title, the learner's file and its check."""

from lessons.grading import check_collectives, check_data, check_ddp, check_sharding
from lessons.grading.runner import Exercise

DEADLOCK = ("a deadlock. If every rank calls a blocking dist.send before its dist.recv, each waits for its "
            "neighbour to receive, and the neighbour is itself stuck in send: send with dist.isend, then recv, "
            "then wait for the send")

EXERCISES = {e.number: e for e in [
    Exercise("03", "the ring all-reduce, from send and recv", "03_ring_all_reduce.py", check_collectives.check_03,
             timeout_s=8.0, hang_hint=DEADLOCK),
    Exercise("04", "average the gradients after backward", "04_average_gradients.py", check_ddp.check_04),
    Exercise("05", "average inside backward, with post-accumulate hooks", "05_gradient_hooks.py", check_ddp.check_05),
    Exercise("06", "launch asynchronously, wait at the end of backward", "06_async_overlap.py", check_ddp.check_06),
    Exercise("07", "flat buckets, launched in order", "07_buckets.py", check_ddp.check_07),
    Exercise("09", "the distributed sampler", "09_distributed_sampler.py", check_data.check_09, on_ranks=False),
    Exercise("10", "SyncBatchNorm's forward statistics", "10_sync_batchnorm.py", check_collectives.check_10),
    Exercise("19", "ZeRO stage 1: step over this rank's shard", "19_zero1_step.py", check_sharding.check_19),
    Exercise("21", "FSDP: gather a unit, compute, free it", "21_fsdp_unit.py", check_sharding.check_21),
]}
