"""The exercises the grader knows: number, title, the learner's file and its check."""

from lessons.grading import check_ddp
from lessons.grading.runner import Exercise

EXERCISES = {e.number: e for e in [
    Exercise("04", "average the gradients after backward", "04_average_gradients.py", check_ddp.check_04),
    Exercise("05", "average inside backward, with post-accumulate hooks", "05_gradient_hooks.py", check_ddp.check_05),
    Exercise("06", "launch asynchronously, wait at the end of backward", "06_async_overlap.py", check_ddp.check_06),
    Exercise("07", "flat buckets, launched in order", "07_buckets.py", check_ddp.check_07),
]}
