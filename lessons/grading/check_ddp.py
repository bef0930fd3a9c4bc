"""Checks of exercises 04-07: the hand-made data-parallel wrappers, on the lessons' bench.

Each ``check_NN(rank, world_size, path)`` runs on every rank and returns the
same list of failures everywhere. Exercises 06 and 07 also watch every
``dist.all_reduce`` call (``watch.Watch``): when and in which step it was
launched, whether it was asynchronous, when its handle was waited for, what
was written into its tensor before that, and which handles are still held
after ``finish()``.
"""

from __future__ import annotations

import gc
import time

import torch
from torch import nn

from lessons._common import FEATURES, make_model
from lessons.grading.bench import STEPS, explain, gather_failures, train_vs_one_process, worst
from lessons.grading.runner import load
from lessons.grading.watch import Watch


class _HandWrapper:
    """Exercise 04's two functions as a wrapper for the bench."""

    def __init__(self, exercise, module: nn.Module):
        self.exercise, self.module = exercise, module
        self.require_sync = True
        exercise.broadcast_parameters(module)

    def __call__(self, x):
        return self.module(x)

    def finish(self) -> None:
        if self.require_sync:
            self.exercise.average_gradients(self.module)


def _never_waited(watch: Watch) -> list[str]:
    """An async all-reduce nobody waited for: its sum never reaches the tensor (the grader holds it until wait())."""
    unwaited = sum(launch.is_async for launch in watch.launches)
    if unwaited and not watch.waits:
        return [f"{unwaited} all-reduces were launched with async_op=True and never waited for: the sum is in the "
                f"tensor only once its handle's wait() has returned. Wait for each, or launch without async_op"]
    return []


def check_04(rank: int, world_size: int, path: str) -> list[str]:
    exercise = load(path)
    with Watch().active() as watch:  # an async all-reduce's sum lands at wait(), never by luck
        seen = train_vs_one_process(lambda m: _HandWrapper(exercise, m), own_seeds=True)
    failures = _never_waited(watch) + explain(seen, world_size)
    return gather_failures(failures or _frozen_failures(exercise, world_size))


def _frozen_failures(exercise, world_size: int) -> list[str]:
    """A parameter that gets no gradient (frozen here: its .grad stays None) must be left alone."""
    model = make_model(seed=0)
    model[0].bias.requires_grad_(False)
    frozen = "with 0.bias frozen (requires_grad False, so its .grad stays None)"
    try:
        seen = train_vs_one_process(lambda m: _HandWrapper(exercise, m), model=model, own_seeds=True)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 -- every rank raises alike: all_reduce(None), None / world_size...
        reason = " ".join(str(error).split()).rstrip(".")
        return [f"{frozen} your code raised {type(error).__name__}: {reason}: skip the parameters whose .grad is "
                f"None, as the docstring asks"]
    return explain(seen, world_size, f"{frozen}: ")


def check_05(rank: int, world_size: int, path: str) -> list[str]:
    exercise = load(path)
    failures = []
    # Mistake B: a post-accumulate hook gets the parameter. Nudge one weight by the rank; backward must not move it.
    model = make_model(seed=0)
    wrapper = exercise.HookAverager(model)
    with torch.no_grad():
        model[-1].weight[0, 0] += rank
    before = model[-1].weight.detach().clone()
    wrapper(torch.randn(4, FEATURES, generator=torch.Generator().manual_seed(rank))).sum().backward()
    if worst((model[-1].weight - before).abs().max().item()) > 0:
        failures.append("backward changed the weights: your hook averaged the parameter itself. A post-accumulate "
                        "hook receives the parameter, not its gradient: average param.grad (lesson 05's mistake B)")
    with Watch().active() as watch:  # an async all-reduce's sum lands at wait(), never by luck
        one = train_vs_one_process(exercise.HookAverager)
        two = train_vs_one_process(exercise.HookAverager, micro_batches=2)
    failures += _never_waited(watch)
    if not failures:
        if one.exact() and not two.exact():
            failures.append("right with one backward per step, wrong when 2 micro-batches accumulate: your hook saw "
                            "only this pass's gradient, so the earlier micro-batch stayed un-averaged in .grad. "
                            "Tensor.register_hook runs before accumulation (lesson 05's mistake A): use "
                            "register_post_accumulate_grad_hook")
        else:
            failures += explain(one, world_size)
            failures += explain(two, world_size, "with 2 micro-batches accumulated: ") if one.exact() else []
    failures += _accumulating_failures(exercise.HookAverager)
    return gather_failures(failures)


def _accumulating_failures(make) -> list[str]:
    """require_sync False, as for every micro-batch but the last: backward and finish() must send nothing."""
    watch = Watch()
    wrapper = make(make_model(seed=0))
    wrapper.require_sync = False
    with watch.active():
        wrapper(torch.randn(4, FEATURES)).sum().backward()
        getattr(wrapper, "finish", lambda: None)()
    if watch.launches:
        return [f"with require_sync False your code still made {len(watch.launches)} all-reduces: while "
                f"micro-batches accumulate nothing should be sent (test self.require_sync in the hook)"]
    return []


def _watched_training(make, model=None) -> tuple:
    """Train through ``make`` on the bench with every all-reduce watched.

    Returns (seen, watch, backward end times, handles held after each finish(), when the first step's last
    gradient was accumulated).
    """
    watch, ends, held, arrivals = Watch(), [], [], []

    def made(module):
        for p in module.parameters():  # hooks registered before the learner's run before theirs
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _: arrivals.append(time.perf_counter()))
        wrapper = make(module)
        finish = wrapper.finish

        def finish_then_count():
            finish()
            gc.collect()  # what is left is what the learner's objects still refer to
            held.append(sorted(h.step for h in watch.handles()))
        wrapper.finish = finish_then_count
        return wrapper

    def step_starts(step):
        watch.step = step

    with watch.active():
        seen = train_vs_one_process(made, lambda: ends.append(time.perf_counter()), model=model,
                                    step_starts=step_starts)
    return seen, watch, ends, held, max(t for t in arrivals if t < ends[0])


def _launch_failures(watch: Watch, last_gradient: float, where: str) -> list[str]:
    """Launched without async_op, never waited for, or waited for while backward still had gradients to compute.

    A wait after the last gradient (in finish(), or in a callback queued with autograd's engine, as lesson
    07b's wrapper does) keeps nothing from overlapping.
    """
    failures = []
    if any(not launch.is_async for launch in watch.launches):
        failures.append(f"an all-reduce was called without async_op=True: {where} waits for it, so backward stands "
                        f"still while it travels")
    if not watch.waits:
        failures.append("nothing ever waited for the all-reduces: finish() must wait for each (handle.wait()) "
                        "before reading the sums, or it reads gradients the sum has not reached")
    elif watch.waits[0] < last_gradient:
        failures.append(f"{where} waited for its all-reduce inside backward, before the last gradient was ready: "
                        f"backward stands still until the sum arrives, so nothing overlaps. Launch with "
                        f"async_op=True and wait in finish()")
    return failures


def _holding_failures(watch: Watch, held: list) -> list[str]:
    """Handles kept after finish(), and tensors written before their wait()."""
    failures = []
    kept = next(((step, steps) for step, steps in enumerate(held) if steps), None)
    if kept:
        step, steps = kept
        launched = sorted({s + 1 for s in steps})
        failures.append(f"after step {step + 1}'s finish() your code still held {len(steps)} all-reduce handles "
                        f"(launched in step{'s' if len(launched) > 1 else ''} {', '.join(map(str, launched))}): "
                        f"finish() must let go of what it waited for (clear self.pending), or every step keeps "
                        f"its handles and buffers alive and the next finish() goes over them again")
    if watch.changed_before_wait:
        failures.append(f"{watch.changed_before_wait} tensors were written (divided?) after their all-reduce was "
                        f"launched and before waiting for it: until wait() returns the sum has not arrived, and "
                        f"when it does it overwrites what you wrote. Wait first, then divide")
    return failures


def check_06(rank: int, world_size: int, path: str) -> list[str]:
    exercise = load(path)
    seen, watch, ends, held, last_gradient = _watched_training(exercise.AsyncAverager)
    n_params = len(list(make_model(seed=0).parameters()))
    failures = _launch_failures(watch, last_gradient, "the hook")
    launched_in_backward = sum(launch.at < ends[0] for launch in watch.launches)
    early = sum(launch.at < last_gradient for launch in watch.launches)  # all but the last gradient's own
    if not failures and launched_in_backward < n_params:
        failures.append(f"only {launched_in_backward} of the {n_params} all-reduces of the first step were launched "
                        f"during backward: the hook must launch each gradient's sum as soon as it is ready")
    elif not failures and early < n_params - 1:
        failures.append(f"only {early} of the {n_params} all-reduces of the first step were launched before the "
                        f"last gradient was ready: the others waited for it, so they did not travel while backward "
                        f"computed. The hook must launch each gradient's sum as soon as it is ready")
    failures += _holding_failures(watch, held)
    failures += explain(seen, world_size)
    failures += _accumulating_failures(exercise.AsyncAverager)
    return gather_failures(failures)


class TwoBranches(nn.Module):
    """Two equal branches whose order in forward depends on the rank: so does the order of their gradients."""

    def __init__(self, swap: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(FEATURES, 16, bias=False), nn.Linear(FEATURES, 16, bias=False)
        self.head = nn.Linear(16, 4, bias=False)
        self.swap = swap

    def forward(self, x):
        if self.swap:  # b first: autograd then reaches a's gradient first
            hb = torch.relu(self.b(x))
            ha = torch.tanh(self.a(x))
        else:
            ha = torch.tanh(self.a(x))
            hb = torch.relu(self.b(x))
        return self.head(ha + hb)


def check_07(rank: int, world_size: int, path: str) -> list[str]:
    exercise = load(path)
    cap = 4096  # the bench model: 4 buckets
    made = []
    seen, watch, ends, held, last_gradient = _watched_training(
        lambda m: made.append(exercise.BucketAverager(m, cap)) or made[-1])
    buckets = len(made[0].buckets)
    failures = _launch_failures(watch, last_gradient, "a bucket")
    per_step = watch.per_step(STEPS)
    off = next((step for step, count in enumerate(per_step) if count != buckets), None)
    if off is not None:
        before = f" (step {off} sent {per_step[off - 1]})" if off else ""
        why = ("is something the step before left behind (self.ready, self.next_bucket) not reset at the end of "
               "finish()?" if off and per_step[off] < buckets else
               "each bucket is sent as one flat tensor (torch.cat of its gradients), once per step")
        failures.append(f"step {off + 1} sent {per_step[off]} all-reduces for {buckets} buckets{before}: {why}")
    elif not failures and watch.launches[0].at > ends[0]:
        failures.append("every bucket left after backward had returned: launch a bucket from the hook as soon as it "
                        "(and every bucket before it) is full, so it travels while backward goes on")
    elif not failures and watch.launches[0].at > last_gradient:
        failures.append("every bucket left once the last gradient was ready, so none traveled while backward "
                        "computed: launch a bucket from the hook as soon as it (and every bucket before it) is "
                        "full, not when all are")
    failures += _holding_failures(watch, held)
    failures += explain(seen, world_size)
    if not failures:  # in-order launching: ranks that fill buckets in different orders
        swapped, *_ = _watched_training(lambda m: exercise.BucketAverager(m, 16 * FEATURES * 4),
                                          model=TwoBranches(swap=rank % 2 == 1))
        if not swapped.exact():
            failures.append("wrong when ranks fill their buckets in different orders (odd ranks compute branch b "
                            "before a): collectives are matched by the order they are called, so one rank's bucket "
                            "was summed with another rank's different bucket. Launch bucket i only after buckets "
                            "0 .. i-1, whatever order they fill in")
    failures += _accumulating_failures(lambda m: exercise.BucketAverager(m, cap))
    return gather_failures(failures)
