"""Checks of exercises 04-07: the hand-made data-parallel wrappers, on the lessons' bench.

Each ``check_NN(rank, world_size, path)`` runs on every rank and returns the
same list of failures everywhere. Exercises 06 and 07 also watch every
``dist.all_reduce`` call (``watch.Watch``): when and in which step it was
launched, whether it was asynchronous, when its handle was waited for, what
was written into its tensor before that, and which handles are still held
after ``finish()``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from lessons._common import FEATURES, make_model
from lessons.grading.ledger import Finding, caller
from lessons.grading.memory import globals_of, reachable_tensors, storage_bytes
from lessons.grading.models import Mixed
from lessons.grading.bench import STEPS, explain, gather_failures, train_vs_one_process, worst
from lessons.grading.runner import load, raised_text
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


def never_waited(watch: Watch) -> list[str]:
    """An async collective nobody waited for: its result never reaches the tensor (the grader holds it until wait())."""
    unwaited = [launch.name for launch in watch.launches if launch.is_async]
    if unwaited and not watch.waits:
        names = ", ".join(f"dist.{name}" for name in sorted(set(unwaited)))
        return [f"{len(unwaited)} collectives ({names}) were launched with async_op=True and never waited for: the "
                f"result is in the tensor only once its handle's wait() has returned. Wait for each, or launch "
                f"without async_op"]
    return []


def _gradient_bytes(model: nn.Module) -> tuple[int, set]:
    """The bytes of one step's gradients (every parameter that requires one), and their dtypes."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return (sum(p.numel() * p.element_size() for p in trainable),
            {str(p.dtype).removeprefix("torch.") for p in trainable})


def dtype_failures(watch: Watch, model: nn.Module) -> list[str]:
    """The learner's all-reduces must carry the gradients in their own dtype: a narrower one rounds the sum."""
    _, dtypes = _gradient_bytes(model)
    sent = sorted({d for launch in watch.launches if launch.name == "all_reduce" for d in launch.dtypes} - dtypes)
    if not sent:
        return []
    return [f"your all-reduces sent {', '.join(sent)} tensors for {', '.join(sorted(dtypes))} gradients: the sum is "
            f"rounded to {', '.join(sent)}'s precision, so the gradients differ from one process's. Send each "
            f"gradient in its own dtype"]


def _cost_failures(watch: Watch, model: nn.Module, steps: int = STEPS) -> list[str]:
    """Each synchronized step may send each gradient once, in its own dtype: the all-reduced bytes of a step are at
    most the gradients' bytes (one all-reduce per gradient, or flat buckets of them, alike)."""
    allowed, dtypes = _gradient_bytes(model)
    for step, sent in enumerate(watch.bytes_per_step(steps)):
        if sent <= allowed:
            continue
        launches = [launch for launch in watch.launches if launch.step == step]
        wider = sorted({d for launch in launches for d in launch.dtypes} - dtypes)
        if wider:
            return [f"step {step + 1} sent {sent:,} bytes for {allowed:,} bytes of {', '.join(sorted(dtypes))} "
                    f"gradients: your all-reduces send {', '.join(wider)} tensors, {sent / allowed:.0f}x the bytes. "
                    f"Send the gradients in their own dtype (torch.cat of them keeps it)"]
        numbers = sum(launch.numel for launch in launches)
        gradient_numbers = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return [f"step {step + 1} all-reduced {numbers:,} numbers in {len(launches)} collectives for "
                f"{gradient_numbers:,} numbers of gradients: each gradient went over the network "
                f"{'twice' if numbers == 2 * gradient_numbers else f'{numbers / gradient_numbers:.1f} times'}. "
                f"All-reduce each gradient once per step: once averaged, every rank holds the same numbers"]
    return []


def check_04(rank: int, world_size: int, path: str) -> list[str]:
    exercise = load(path)
    watch = Watch()
    with watch.active():  # an async all-reduce's sum lands at wait(), never by luck
        seen = train_vs_one_process(lambda m: _HandWrapper(exercise, m), own_seeds=True,
                                    step_starts=lambda step: setattr(watch, "step", step))
    failures = never_waited(watch) or (explain(seen, world_size) and dtype_failures(watch, make_model(seed=0)))
    failures = failures or explain(seen, world_size) or _cost_failures(watch, make_model(seed=0))
    failures = failures or _frozen_failures(exercise, world_size)
    failures = failures or family_failures(lambda m: _HandWrapper(exercise, m), path, own_seeds=True)
    return gather_failures(failures)


def _frozen_failures(exercise, world_size: int) -> list[str]:
    """A parameter that gets no gradient (frozen here: its .grad stays None) must be left alone."""
    model = make_model(seed=0)
    model[0].bias.requires_grad_(False)
    frozen = "with 0.bias frozen (requires_grad False, so its .grad stays None)"
    try:
        seen = train_vs_one_process(lambda m: _HandWrapper(exercise, m), model=model, own_seeds=True)
    except (NotImplementedError, Finding):
        raise
    except Exception as error:  # noqa: BLE001 -- every rank raises alike: all_reduce(None), None / world_size...
        reason = " ".join(str(error).split()).rstrip(".")
        return [f"{frozen} your code raised {type(error).__name__}: {reason}: skip the parameters whose .grad is "
                f"None, as the docstring asks"]
    if seen.frozen_with_grad:
        return [f"{frozen} your code gave {', '.join(seen.frozen_with_grad)} a .grad: a frozen parameter's .grad "
                f"must stay None. An optimizer skips a parameter whose .grad is None, but moves one whose .grad is "
                f"zeros when it has momentum or weight decay: leave the parameters whose .grad is None alone"]
    return explain(seen, world_size, f"{frozen}: ")


def family_failures(make, path: str, sometimes: bool = True, own_seeds: bool = False) -> list[str]:
    """Train ``make(model)`` on ``models.Mixed`` (a frozen parameter, a shared one and, with ``sometimes``, one
    without a gradient on odd steps), in float32 and then as a bfloat16 copy, against one process, every
    collective and hook registration counted by step.

    What must hold at every step: the gradients the single process gets; ``.grad`` None where the parameter
    got none; the same collectives and bytes in step 3 as in step 1 (both use every layer); no hook registered
    once training has begun; each gradient sent in its own dtype.
    """
    for dtype in (torch.float32, torch.bfloat16):
        failures = _family_failures(make, path, sometimes, own_seeds, dtype)
        if failures:
            return failures
    return []


def _family_failures(make, path: str, sometimes: bool, own_seeds: bool, dtype: torch.dtype) -> list[str]:
    Mixed.use_extra = True
    model = Mixed(sometimes).to(dtype)
    copy_of = "" if dtype == torch.float32 else f"a {str(dtype).removeprefix('torch.')} copy of "
    what = f"on {copy_of}a model with {Mixed.CASES if sometimes else Mixed.CASES_WITHOUT_EXTRA}: "
    watch, registered, unused_with_grad = Watch(), [], []

    def made(module):
        wrapper = make(module)
        finish = getattr(wrapper, "finish", lambda: None)

        def finish_then_look():
            finish()
            if module.extra is not None and not Mixed.use_extra and watch.step not in [s for s, _ in unused_with_grad]:
                given = [f"extra.{n}" for n, p in module.extra.named_parameters() if p.grad is not None]
                if given:
                    unused_with_grad.append((watch.step, given))
        wrapper.finish = finish_then_look
        return wrapper

    def step_starts(step):
        Mixed.step_starts(step)
        watch.step = step

    try:
        with watch.active(), hooks_registered(set(), registered, watch):
            seen = train_vs_one_process(made, model=model, own_seeds=own_seeds, step_starts=step_starts)
    except (NotImplementedError, Finding):
        raise
    except Exception as error:  # noqa: BLE001 -- e.g. a hook registered on the frozen parameter
        return [what + raised_text(error, os.path.abspath(path))[0]]
    finally:
        Mixed.use_extra = True
    if seen.frozen_with_grad:
        return [f"{what}your code gave {', '.join(seen.frozen_with_grad)} a .grad: a frozen parameter's .grad "
                f"must stay None (an optimizer with momentum or weight decay moves a parameter whose .grad is "
                f"zeros, and skips one whose .grad is None)"]
    if unused_with_grad:
        step, given = unused_with_grad[0]
        return [f"{what}on step {step + 1}, where extra took no part in the loss, your code gave {', '.join(given)} "
                f"a .grad: a parameter that got no gradient in this step must keep .grad None. Skip the parameters "
                f"whose .grad is None (requires_grad alone does not tell)"]
    late = [(step, where) for step, where in registered if step >= 0]
    if late:
        step, where = late[0]
        count = sum(1 for s, _ in late if s == step)
        return [f"your code registered {count} hook{'s' if count > 1 else ''} during step {step + 1} ({where}), "
                f"after the wrapper was built: hooks registered at every step pile up, each running once more per "
                f"backward. Register each parameter's hook once, when the wrapper is built"]
    failures = explain(seen, dist.get_world_size(), what)
    return failures or [what + failure for failure in steady_failures(watch) + _cost_failures(watch, model)][:1]


def accumulated_failures(make) -> list[str]:
    """Training with 2 micro-batches per step (require_sync False for the first) against one process."""
    with Watch().active():  # an async sum lands at wait(), never by luck
        seen = train_vs_one_process(make, micro_batches=2)
    return explain(seen, dist.get_world_size(), "with 2 micro-batches accumulated per step: ")


def steady_failures(watch: Watch, first: int = 0, later: int = STEPS - 1) -> list[str]:
    """Steps alike in what they compute must be alike in what they send: counted across steps."""
    def counted(step):
        launches = [launch for launch in watch.launches if launch.step == step]
        return len(launches), sum(launch.nbytes for launch in launches)
    (n1, b1), (n2, b2) = counted(first), counted(later)
    if (n1, b1) == (n2, b2):
        return []
    return [f"step {later + 1} made {n2} collectives sending {b2:,} bytes, where step {first + 1}, which computes "
            f"the same gradients, made {n1} sending {b1:,}: something of your code piles up (or runs out) from step "
            f"to step (hooks registered again, a list never cleared, a counter never reset?)"]


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
    kinds = set()
    with Watch().active() as watch, hooks_registered(kinds):  # an async sum lands at wait(), never by luck
        one = train_vs_one_process(exercise.HookAverager)
        two = train_vs_one_process(exercise.HookAverager, micro_batches=2)
    failures += never_waited(watch)
    accumulating = _accumulating_failures(exercise.HookAverager)
    if not failures:
        if one.exact() and not two.exact() and kinds == {"register_hook"}:
            failures.append("right with one backward per step, wrong when 2 micro-batches accumulate: your hook saw "
                            "only this pass's gradient, so the earlier micro-batch stayed un-averaged in .grad. "
                            "Tensor.register_hook runs before accumulation (lesson 05's mistake A): use "
                            "register_post_accumulate_grad_hook")
        elif one.exact() and not two.exact():
            failures += accumulating or [
                "right with one backward per step, wrong when 2 micro-batches accumulate: after the last backward "
                "each .grad must hold the average of every micro-batch's gradient, each averaged exactly once"]
        else:
            failures += explain(one, world_size)
            failures += explain(two, world_size, "with 2 micro-batches accumulated: ") if one.exact() else []
    failures += [f for f in accumulating if f not in failures]
    failures = failures or family_failures(exercise.HookAverager, path)
    return gather_failures(failures)


def _accumulating_failures(make) -> list[str]:
    """require_sync False, as for every micro-batch but the last: backward and finish() must send nothing, and
    leave in .grad the plain gradient, as one process's backward leaves it."""
    watch, model = Watch(), make_model(seed=0)
    plain = copy.deepcopy(model)
    wrapper = make(model)
    wrapper.require_sync = False
    x = torch.randn(4, FEATURES, generator=torch.Generator().manual_seed(dist.get_rank()))
    before = _bookkeeping(wrapper)
    with watch.active():
        wrapper(x).sum().backward()
        during = _bookkeeping(wrapper)
        getattr(wrapper, "finish", lambda: None)()
    if watch.launches:
        return [f"with require_sync False your code still made {len(watch.launches)} all-reduces: while "
                f"micro-batches accumulate nothing should be sent (test self.require_sync in the hook)"]
    moved = [f"self.{name} from {before[name]} to {during[name]}" for name in before
             if name in during and during[name] != before[name]]
    if moved:
        return [f"with require_sync False, backward changed {', '.join(moved)}: the hook must do nothing while "
                f"micro-batches accumulate (\"only when self.require_sync is True\"), or what it counted then is "
                f"counted again in the synchronized backward. Test self.require_sync first, and return"]
    plain(x).sum().backward()
    changed = [name for (name, p), q in zip(model.named_parameters(), plain.parameters())
               if p.grad is not None and not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)]
    if changed:
        return [f"with require_sync False, .grad after backward and finish() is not the plain gradient (of "
                f"{', '.join(changed)}): while micro-batches accumulate, nothing may change .grad (no division, "
                f"in the hook or in finish()), so that the last, synchronized backward averages each "
                f"micro-batch's once"]
    return []


def _bookkeeping(wrapper) -> dict[str, str]:
    """The wrapper's own counters and flags (numbers, and lists or tuples of them), as text: what its hooks keep
    track of between gradients."""
    plain = (int, float, bool)
    return {name: repr(value) for name, value in vars(wrapper).items() if name != "require_sync" and (
        isinstance(value, plain) or (isinstance(value, (list, tuple)) and all(isinstance(v, plain) for v in value)))}


@contextlib.contextmanager
def hooks_registered(kinds: set, registered: list | None = None, watch: Watch | None = None):
    """Note, in ``kinds``, which of ``Tensor.register_hook`` / ``register_post_accumulate_grad_hook`` the learner
    called; in ``registered``, (the watch's step, where) for each registration."""
    originals = {name: getattr(torch.Tensor, name) for name in ("register_hook", "register_post_accumulate_grad_hook")}

    def noting(name):
        def register(tensor, hook):
            kinds.add(name)
            if registered is not None:
                where, own = caller(None)
                if not own:
                    registered.append((watch.step if watch is not None else -1, where))
            return originals[name](tensor, hook)
        return register

    for name in originals:
        setattr(torch.Tensor, name, noting(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def held_tensors(owner, module: nn.Module) -> dict[str, int]:
    """{attribute: bytes of the tensors it holds}, through lists, tuples, sets and dicts: what an object keeps
    between steps. The module's parameters (and the module) are its to hold, not counted; a storage counts once."""
    own = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen, held = set(own), {}

    def walk(value, depth: int) -> int:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage.data_ptr() in seen or value.device.type == "meta":
                return 0
            seen.add(storage.data_ptr())
            return storage.nbytes()
        if depth > 4 or isinstance(value, (nn.Module, str, bytes)):
            return 0
        if isinstance(value, dict):
            return sum(walk(k, depth + 1) + walk(v, depth + 1) for k, v in value.items())
        if isinstance(value, (list, tuple, set, frozenset)):
            return sum(walk(v, depth + 1) for v in value)
        return 0

    for name, value in vars(owner).items():
        held[f"self.{name}"] = walk(value, 0)
    return held


def growth_failures(kept: list[dict[str, int]], clear_in: str = "finish()") -> list[str]:
    """What the learner's object holds after each step must not grow from step to step."""
    first, last = kept[0], kept[-1]
    growing = [name for name in last if last[name] > first.get(name, 0)]
    if not growing:
        return []
    sizes = ", ".join(f"{name}: {first.get(name, 0):,} bytes after step 1, {last[name]:,} after step {len(kept)}"
                      for name in growing)
    return [f"the tensors your object keeps between steps grow every step ({sizes}): a step must let go of what "
            f"it made (clear it in {clear_in}), or memory grows until the process runs out"]


def _watched_training(make, model=None, keep_sent: bool = False) -> tuple:
    """Train through ``make`` on the bench with every collective watched.

    Returns (seen, watch, backward end times, handles held after each finish(), when the first step's last
    gradient was accumulated, the tensors the wrapper held after each finish() by attribute, this rank's own
    gradients after the first backward, before finish(), by parameter).
    """
    watch, ends, held, arrivals, kept = Watch(keep_sent), [], [], [], []
    modules, local = [], {}

    def backward_done():
        ends.append(time.perf_counter())
        if len(ends) == 1:
            local.update({p: p.grad.detach().clone() for p in modules[0].parameters() if p.grad is not None})

    def made(module):
        modules.append(module)
        for p in module.parameters():  # hooks registered before the learner's run before theirs
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _: arrivals.append(time.perf_counter()))
        wrapper = make(module)
        finish = wrapper.finish

        def finish_then_count():
            finish()
            gc.collect()  # what is left is what the learner's objects still refer to
            held.append(sorted(h.step for h in watch.handles()))
            kept.append(held_tensors(wrapper, module))
            reached = reachable_tensors(wrapper, modules=globals_of(wrapper))
            kept[-1]["all your object reaches"] = storage_bytes(
                reached, excluded=[t for p in module.parameters() for t in (p, p.grad)])
        wrapper.finish = finish_then_count
        return wrapper

    def step_starts(step):
        watch.step = step

    with watch.active():
        seen = train_vs_one_process(made, backward_done, model=model, step_starts=step_starts)
    return seen, watch, ends, held, max(t for t in arrivals if t < ends[0]), kept, local


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
    seen, watch, ends, held, last_gradient, kept, _ = _watched_training(exercise.AsyncAverager)
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
    failures = failures or _cost_failures(watch, make_model(seed=0)) + growth_failures(kept)
    failures += _accumulating_failures(exercise.AsyncAverager)
    failures = failures or steady_failures(watch) or accumulated_failures(exercise.AsyncAverager)
    failures = failures or family_failures(exercise.AsyncAverager, path)
    return gather_failures(failures)


class TwoBranches(nn.Module):
    """Two branches whose order in forward depends on the rank: so does the order of their gradients.

    Four equal weights, registered a, p, b, head: with a cap of two, buckets [head, b] and [p, a]. Even ranks
    compute branch A (a then p) first, so b's gradient arrives before p's and a's: bucket 0 fills first. Odd ranks
    compute B first: bucket 1 fills first. Equal buckets, so that ranks launching different buckets at once
    mismatch their sums, not their sizes (which Gloo would stop them for)."""

    def __init__(self, swap: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.p, self.b, self.head = (nn.Linear(16, 16, bias=False) for _ in range(4))
        self.swap = swap

    def forward(self, x):
        if self.swap:  # B first: autograd then reaches A's gradients first
            hb = torch.relu(self.b(x))
            ha = self.p(torch.tanh(self.a(x)))
        else:
            ha = self.p(torch.tanh(self.a(x)))
            hb = torch.relu(self.b(x))
        return self.head(ha + hb)

    CAP = 2 * 16 * 16 * 4  # two weights per bucket


def check_07(rank: int, world_size: int, path: str) -> list[str]:
    exercise = load(path)
    cap = 4096  # the bench model: 4 buckets
    made = []
    seen, watch, ends, held, last_gradient, kept, _ = _watched_training(
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
    failures = failures or _cost_failures(watch, make_model(seed=0)) + growth_failures(kept)
    if not failures:  # in-order launching: ranks that fill buckets in different orders
        failures.append(_swapped_failure(exercise, rank))
    failures = [f for f in failures if f]
    failures += _accumulating_failures(lambda m: exercise.BucketAverager(m, cap))
    failures = failures or accumulated_failures(lambda m: exercise.BucketAverager(m, cap))
    failures = failures or family_failures(lambda m: exercise.BucketAverager(m, cap), path, sometimes=False)
    return gather_failures(failures)


def _swapped_failure(exercise, rank: int) -> str:
    """Ranks whose gradients arrive in different orders (``TwoBranches``): what each launched tensor held, bucket by
    bucket, names the mistake."""
    made = []
    swapped, watch, *_, local = _watched_training(
        lambda m: made.append(exercise.BucketAverager(m, TwoBranches.CAP)) or made[-1],
        model=TwoBranches(swap=rank % 2 == 1), keep_sent=True)
    if swapped.exact():
        return ""
    flats = [torch.cat([local[p].reshape(-1) for p in bucket]) for bucket in made[0].buckets]
    first_step = [launch.sent for launch in watch.launches if launch.step == 0 and launch.sent is not None]
    order = [next((i for i, flat in enumerate(flats) if flat.shape == sent.shape and torch.equal(flat, sent)), None)
             for sent in first_step]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, order)
    if any(i is None for order in everyone for i in order):
        return ("wrong when ranks' gradients arrive in different orders (odd ranks compute branch B before A): a "
                "tensor you all-reduced held other gradients than any one bucket of self.buckets (filled in the "
                "order they arrived?), so the ranks summed different parameters together. Fill bucket i with "
                "exactly the parameters self.buckets[i] lists, the same on every rank, whatever order they arrive in")
    if any(order != sorted(order) for order in everyone):
        return ("wrong when ranks fill their buckets in different orders (odd ranks compute branch B before A): "
                f"the ranks launched their buckets in the orders {everyone}, and collectives are matched by the "
                "order they are called, so one rank's bucket was summed with another rank's different bucket. "
                "Launch bucket i only after buckets 0 .. i-1, whatever order they fill in")
    return ("wrong when ranks' gradients arrive in different orders (odd ranks compute branch B before A), though "
            "every rank launched its buckets in order: " + (explain(swapped, dist.get_world_size()) or [""])[0])
