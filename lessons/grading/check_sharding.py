"""Checks of exercises 19 (ZeRO-1's step over a shard) and 21 (FSDP's gather-compute-free of a unit)."""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lessons._common import CLASSES, FEATURES, make_model
from lessons.grading.bench import PER_RANK, agree, flat_weights, gather_failures, worst
from lessons.grading.check_ddp import growth_failures, held_tensors, never_waited
from lessons.grading.ledger import own
from lessons.grading.memory import Followed, globals_of, reachable_tensors, storage_bytes
from lessons.grading.runner import EXERCISE_PREFIX, load
from lessons.grading.watch import Watch

STEPS = 3
_all_reduce = own.all_reduce  # the grader's own


def check_19(rank: int, world_size: int, path: str) -> list[str]:
    exercise = load(path)
    # Plain SGD first: its step is the gradient's, scaled, so a gradient of the wrong scale shows as such
    # (AdamW divides by the gradient's own scale); then AdamW, whose state ZeRO-1 shards. Every collective
    # watched: an asynchronous one's result lands at wait(), never by luck.
    with Watch().active(exercise) as watch:
        sharded, failures, kept = _train_19(exercise, rank, world_size, torch.optim.SGD, lr=0.1, watch=watch)
    narrower = sorted({d for launch in watch.launches for d in launch.dtypes} - {"float32"})
    if failures and narrower:
        failures = [f"your collectives sent {', '.join(narrower)} tensors of float32 parameters or gradients: "
                    f"the numbers come back rounded, so the parameters are not plain SGD's (bit for bit, as the "
                    f"docstring says). Send the float32 pieces as they are"]
    failures = (never_waited(watch) or failures or _cost_19(watch, sharded, world_size)
                or growth_failures([{k: v for k, v in held.items() if k != PEAK} for held in kept],
                                   clear_in="step()"))
    if not failures:
        sharded, failures, kept = _train_19(exercise, rank, world_size, torch.optim.AdamW, lr=1e-2)
        failures += _state_failures(sharded, torch.optim.AdamW, lr=1e-2)
        failures = failures or _memory_19(kept, sharded, torch.optim.AdamW, lr=1e-2) or _peak_19(kept, sharded)
    return gather_failures(failures)


def _train_19(exercise, rank: int, world_size: int, optimizer_class, watch: Watch | None = None,
              **defaults) -> tuple:
    """STEPS steps of the learner's ShardedOptimizer against ``optimizer_class`` stepping every parameter.

    Returns (the ShardedOptimizer, [what went wrong at the first step that differs], the tensors it held
    after each step by attribute). With a ``watch``, its step is ``GRADIENT`` from each ``step()``'s start
    and ``PARAMETERS`` from when the inner optimizer (``self.optimizer``) steps.
    """
    mine, plain = make_model(seed=0), make_model(seed=0)
    sharded = exercise.ShardedOptimizer(mine.parameters(), optimizer_class, **defaults)
    reference = optimizer_class(plain.parameters(), **defaults)
    if watch is not None:
        _mark_the_inner_step(sharded, watch)
    data = torch.Generator().manual_seed(7)
    kept = []
    for step in range(STEPS):
        x = torch.randn(world_size, PER_RANK, FEATURES, generator=data)
        y = torch.randint(0, CLASSES, (world_size, PER_RANK), generator=data)
        sharded.zero_grad()
        nn.functional.cross_entropy(mine(x[rank]), y[rank]).backward()
        for p, q in zip(mine.parameters(), plain.parameters()):
            _all_reduce(p.grad)
            p.grad /= world_size
            q.grad = p.grad.clone()  # the plain optimizer steps the same averaged gradients, all of them
        before = flat_weights(mine)
        if watch is not None:
            watch.step = GRADIENT
        with Followed() as followed:
            sharded.step()
        reference.step()
        kept.append(held_tensors(sharded, mine))
        kept[-1][PEAK] = followed.peak - followed.alive()  # the temporaries: what step() kept (state) aside
        after, right = flat_weights(mine), flat_weights(plain)
        if worst(float(after.isnan().any())):
            return sharded, [f"after step {step + 1} parameters hold NaN: {READ_EARLY}"], kept
        model_tensors = [t for p in mine.parameters() for t in (p, p.grad)]
        kept[-1][REACHED] = storage_bytes(reachable_tensors(sharded, modules=[exercise]), excluded=model_tensors)
        name = optimizer_class.__name__
        if not worst((after - right).abs().max().item()) < 1e-6:  # NaN too
            if step and optimizer_class is torch.optim.SGD and \
                    worst(float(not torch.allclose(after - before, right - before + last_move, atol=1e-6))) == 0:
                return sharded, [f"step {step + 1} moved the parameters by this step's SGD step plus step "
                                 f"{step}'s (step 1 was right): the shard's gradient kept the last step's. Set "
                                 f"self.shard.grad to this step's piece (=, not +=): zero_grad clears only the "
                                 f"parameters' gradients"], kept
            return sharded, [_wrong_step(step, before, after, right, sharded.piece, rank, world_size, name)], kept
        last_move = after - before
        if worst(float(not torch.equal(after, right))):
            return sharded, [_not_bit_for_bit(step, after, right, name)], kept
        if not agree(after):
            return sharded, [f"after step {step + 1} the ranks' parameters are not bit for bit the same (within "
                             f"1e-6 of plain {name}'s on every rank): every rank must copy in the very numbers "
                             f"each piece's owner computed"], kept
    return sharded, [], kept


READ_EARLY = ("the grader leaves an asynchronous all-gather's (or reduce-scatter's) output NaN until its wait() "
              "returns, as a real one may still be writing it, so your code read one before waiting for it. Call "
              "wait() on the handle first, then read the result")
REACHED = "all your object reaches"  # the key, in what _train_19 keeps, of every tensor the object reaches
PEAK = "the most step() held at once"  # and of the peak bytes of the temporaries step() made


def _not_bit_for_bit(step: int, after: torch.Tensor, right: torch.Tensor, name: str) -> str:
    """Right within float32 rounding, yet not the same bits: the docstring promises bit for bit."""
    differ = (after != right).sum().item()
    ulps = ((after - right).abs() / torch.finfo(torch.float32).eps / right.abs().clamp_min(1e-30)).max().item()
    return (f"after step {step + 1} {differ:,} of the {after.numel():,} parameters differ from plain {name}'s "
            f"by up to {(after - right).abs().max():.2g} (about {ulps:.0f} units in the last place): the step "
            f"must be bit for bit plain {name}'s, as the docstring says. The same arithmetic on the same numbers "
            f"gives the same bits: step self.shard with self.optimizer on the averaged gradient as it is, and "
            f"copy the updated numbers back without computing with them")


# The two phases of a ZeRO-1 step, as the watch's step: getting this rank's piece of the gradient, and
# bringing every rank's updated piece to every rank.
GRADIENT, PARAMETERS = 0, 1
SLACK = 1.1  # what a step may move beyond the budget (a little padding, say); a collective too many is 2x


@dataclass
class _PhaseCost:
    """What one phase's collectives moved, per rank and step, and how they were called."""
    moved: float  # bytes, by ``Launch.moved``
    names: str  # "dist.all_gather, dist.all_reduce"
    wider: list[str]  # dtypes sent wider than the float32 the exercises train in
    all_reduce: bool  # one of them an all-reduce


def _phase_cost(watch: Watch, phase: int, world_size: int) -> _PhaseCost:
    launches = [launch for launch in watch.launches if launch.step == phase]
    return _PhaseCost(sum(launch.moved(world_size) for launch in launches) / STEPS,
                      ", ".join(sorted({f"dist.{launch.name}" for launch in launches})),
                      sorted({d for launch in launches for d in launch.dtypes} - {"float32"}),
                      any(launch.name == "all_reduce" for launch in launches))


def _mark_the_inner_step(sharded, watch: Watch) -> None:
    """From the moment ``self.optimizer`` steps, what the step sends is the parameters'."""
    inner = getattr(sharded, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        return
    step = inner.step

    def marked(*args, **kwargs):
        watch.step = PARAMETERS
        return step(*args, **kwargs)
    inner.step = marked


def _cost_19(watch: Watch, sharded, world_size: int) -> list[str]:
    """Bytes each rank moves per step, by phase, against the algorithm's: the gradient needs no collective
    (every p.grad holds the average: cut this rank's piece), or one reduce-scatter of the flat gradients;
    the parameters, one all-gather of the pieces (or the owner's broadcast of each)."""
    if not any(launch.step == PARAMETERS for launch in watch.launches):
        return []  # the inner optimizer was never called: the step's results have already said what is wrong
    line = world_size * sharded.piece * 4  # the padded flat line, float32
    share = (world_size - 1) / world_size
    budgets = {GRADIENT: share * line, PARAMETERS: share * line}
    for phase, budget in budgets.items():
        cost = _phase_cost(watch, phase, world_size)
        if cost.moved <= SLACK * budget:
            continue
        if phase == GRADIENT:
            why = ("an all-reduce of the gradients moves twice what a reduce-scatter moves, and sums what is "
                   "already averaged" if cost.all_reduce else
                   f"your collectives send {', '.join(cost.wider)}" if cost.wider else "more than one reduce-scatter")
            return [f"before self.optimizer steps, each rank moves {cost.moved:,.0f} bytes per step over the "
                    f"network ({cost.names}) to get its piece of the gradient, where one reduce-scatter of the flat "
                    f"gradients moves {budget:,.0f}: {why}. Every p.grad already holds the average over the ranks: "
                    f"cut this rank's piece from it (self.my_piece), no collective needed"]
        why = ("an all-reduce of the whole line (zeros outside this rank's piece) moves twice what an all-gather "
               "of the pieces moves" if cost.all_reduce else
               f"your collectives send {', '.join(cost.wider)}: send the float32 shard as it is" if cost.wider else
               f"{cost.moved / budget:.1f}x what one all-gather moves")
        return [f"after self.optimizer steps, each rank moves {cost.moved:,.0f} bytes per step over the network "
                f"({cost.names}) to bring the updated pieces to every rank, where one all-gather of the "
                f"{sharded.piece:,}-element pieces moves {budget:,.0f}: {why}. All-gather each rank's piece once"]
    return []


def _wrong_step(step: int, before: torch.Tensor, after: torch.Tensor, right: torch.Tensor, piece: int, rank: int,
                world_size: int, name: str) -> str:
    """What went wrong in a step whose parameters differ from the plain optimizer's: which piece holds what."""
    numel = after.numel()
    pieces = [slice(r * piece, min((r + 1) * piece, numel)) for r in range(world_size)]
    moved = [not torch.equal(after[s], before[s]) for s in pieces]
    close = lambda a, b: torch.allclose(a, b, atol=1e-6)  # noqa: E731
    if not any(moved):
        return ("the parameters did not move: give self.shard its gradient (this rank's piece of every p.grad, "
                "laid end to end), step self.optimizer, and copy the updated pieces back")
    if close(after - before, world_size * (right - before)):
        return (f"after step {step + 1} the parameters moved {world_size}x as far as with plain {name}: your shard "
                f"stepped with {world_size}x the averaged gradient. Every p.grad already holds the average over the "
                f"ranks, and a reduce-scatter (or all-reduce) of it sums it again: divide by {world_size}, or just "
                f"cut this rank's piece from it")
    if close(after - before, (right - before) / world_size):
        return (f"after step {step + 1} the parameters moved 1/{world_size} as far as with plain {name}: your shard "
                f"stepped with 1/{world_size} of the averaged gradient. Every p.grad already holds the average over "
                f"the ranks: do not divide it again")
    if moved[rank] and close(after[pieces[rank]], right[pieces[rank]]) and \
            not any(moved[r] for r in range(world_size) if r != rank):
        return (f"rank {rank} updated only its own piece of the parameters; the others kept their old values, so "
                f"the ranks' weights differ after the step: all-gather every rank's updated piece and copy them "
                f"into the parameters")
    padded = nn.functional.pad(right, (0, piece * world_size - numel))
    landed = {}  # slot -> the rank whose right piece it holds
    for slot, where in enumerate(pieces):
        length = where.stop - where.start
        landed[slot] = next((r for r in range(world_size)
                             if close(after[where], padded[r * piece:r * piece + length])), None)
    if all(r is not None for r in landed.values()) and any(r != slot for slot, r in landed.items()):
        misplaced = [f"rank {slot}'s piece holds rank {r}'s" for slot, r in landed.items() if r != slot]
        placed = [str(slot) for slot, r in landed.items() if r == slot]
        return (f"after step {step + 1} the updated pieces landed in the wrong places: {', '.join(misplaced)}"
                + (f" (rank {', '.join(placed)}'s {'is' if len(placed) == 1 else 'are'} right)" if placed else "")
                + f": all_gather fills its list in rank order (tensor r receives rank r's piece), and rank r's "
                  f"piece belongs at elements r * {piece} onward")
    wrong = [r for r, where in enumerate(pieces) if not close(after[where], right[where])]
    others = " (the others are right)" if 0 < len(wrong) < world_size else ""
    where = (f"in every rank's piece" if len(wrong) == world_size else
             f"in the pieces of rank{'s' if len(wrong) > 1 else ''} {', '.join(map(str, wrong))}{others}")
    stateful = (f": step {step} was right, and {name}'s step uses the state it kept from the steps before "
                f"(exp_avg, exp_avg_sq, its step count). Is self.optimizer, or its state, made anew at every "
                f"step? Keep the one __init__ built") if step and name == "AdamW" else ""
    return (f"after step {step + 1} the parameters differ from plain {name}'s by up to "
            f"{(after - right).abs().max():.2g}, {where}{stateful}")


def _optimizers(owner) -> dict[str, torch.optim.Optimizer]:
    """The optimizers an object holds in its attributes (or in lists and dicts there), by where they are."""
    found = {}
    for name, value in vars(owner).items():
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else []
        if isinstance(value, torch.optim.Optimizer):
            found[f"self.{name}"] = value
        found.update({f"self.{name}[{key!r}]": v for key, v in items if isinstance(v, torch.optim.Optimizer)})
    return found


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)  # the step counters aside


def _memory_19(kept: list[dict], sharded, optimizer_class, **defaults) -> list[str]:
    """What the whole process holds after a step (every live tensor, the models and the grader's data aside)
    against what ZeRO-1 needs: this rank's piece, its gradient, the optimizer's state for it."""
    piece = torch.zeros(sharded.piece, requires_grad=True)
    piece.grad = torch.zeros_like(piece)
    alone = optimizer_class([piece], **defaults)
    alone.step()
    one = sharded.piece * 4
    allowed = 2 * one + _state_bytes(alone) + one + 1024  # + one piece and 1 KB of slack (padding, counters)
    held = max(k[REACHED] for k in kept)
    if worst(float(held > allowed)) == 0:
        return []
    held = int(worst(float(held)))
    grad = getattr(getattr(sharded, "shard", None), "grad", None)
    if isinstance(grad, torch.Tensor) and grad.untyped_storage().nbytes() > grad.numel() * grad.element_size():
        return [f"after a step your object reaches {held:,} bytes of tensors besides the model's parameters and "
                f"gradients, where ZeRO-1 needs about {allowed - one - 1024:,}: self.shard.grad is a view of a "
                f"{grad.untyped_storage().nbytes() // grad.element_size():,}-element tensor (the whole line of "
                f"gradients), which it keeps alive between steps. Give the shard a copy of its piece "
                f"(.clone()), so the line is freed"]
    attributes = sorted(((n, b) for n, b in kept[-1].items() if n != REACHED and b > one), key=lambda x: -x[1])
    named = (f" ({', '.join(f'{n}: {b:,} bytes' for n, b in attributes)})" if attributes else
             " (none of it in your object's attributes: in a closure, a global, a cache?)")
    return [f"after a step your object reaches {held:,} bytes of tensors besides the model's parameters and "
            f"gradients{named}, where ZeRO-1 needs about {allowed - one - 1024:,}: this rank's "
            f"{sharded.piece:,}-element piece, its gradient and {optimizer_class.__name__}'s state for it. Keep "
            f"no full copy of the parameters (or gradients) between steps: that is the memory ZeRO-1 saves"]


def _peak_19(kept: list[dict], sharded) -> list[str]:
    """The most the temporaries ``step()`` made held at once (what it kept, the optimizer's state and the shard's
    gradient, aside), against a flat ZeRO-1 step's: the gradients laid end to end, that line padded, and the
    line the updated pieces are gathered into (three lines), and a few pieces (a copy of this rank's piece of the
    gradient, the optimizer's own temporaries)."""
    line, piece = sharded.piece * sharded.world_size * 4, sharded.piece * 4
    allowed = 3 * line + 3 * piece + 1024
    peak = int(worst(float(max(k[PEAK] for k in kept))))
    if peak <= allowed:
        return []
    return [f"at its peak step() held {peak:,} bytes of temporaries, {peak / line:.1f} times the "
            f"{line:,}-byte line of parameters (padded), where a ZeRO-1 step needs at most three lines (the "
            f"gradients end to end, padded, and the line the pieces are gathered into) and a few pieces: "
            f"{allowed:,} bytes. Gather the updated pieces into one line (dist.all_gather_into_tensor, or "
            f"all_gather into views of it), not into a full-size buffer per rank, and let each temporary go "
            f"once it is used"]


def _state_failures(sharded, optimizer_class, **defaults) -> list[str]:
    """ZeRO-1's point: this rank keeps optimizer state for its piece only. Compare with one optimizer on the piece."""
    optimizers = _optimizers(sharded)
    held = sum(_state_bytes(o) for o in optimizers.values())
    if not held:
        return ["self.optimizer never stepped: the optimizer state of this rank's piece lives there"]
    piece = torch.zeros(sharded.piece, requires_grad=True)
    piece.grad = torch.zeros_like(piece)
    alone = optimizer_class([piece], **defaults)
    alone.step()
    allowed = _state_bytes(alone)
    if held <= allowed:
        return []
    elements = sum(p.numel() for o in optimizers.values() for g in o.param_groups for p in g["params"])
    return [f"rank {dist.get_rank()} holds {held:,} bytes of optimizer state (in {', '.join(optimizers)}, over "
            f"{elements:,} elements): {held / allowed:.1f}x the {allowed:,} bytes of this rank's piece of "
            f"{sharded.piece:,} elements. ZeRO-1 saves memory by keeping each rank's optimizer state for its piece "
            f"only: step self.shard with the optimizer __init__ built, not every parameter"]


class Watched:
    """Wraps every unit's gather: notes each call's phase, the bytes of earlier gathered tensors still alive, and
    (while ``followed`` follows the step) the bytes of any unit-sized tensor the step made that is still alive:
    a copy of a unit's full parameters, or a full gradient, wherever it is kept."""

    def __init__(self, units):
        self.units, self.phase, self.late, self.others = units, "forward", [], []
        self.gathers = []  # (phase, unit index), this step's
        self.followed: Followed | None = None
        # the bytes of a unit's full parameters, or of its full gradient: padded, or not
        self.full_sizes = {n * 4 for u in units for n in (u.piece * u.world_size, u.numel)}
        for index, unit in enumerate(units):
            original = unit.gather

            def gather(original=original, index=index):
                held = self.held()
                if held:
                    self.late.append((self.phase, index, held))
                alive = self.followed.alive(self.full_sizes) if self.followed is not None else 0
                if alive:
                    self.others.append((self.phase, index, alive))
                self.gathers.append((self.phase, index))
                return original()
            unit.gather = gather

    def held(self) -> int:
        return sum(t.untyped_storage().nbytes() for u in self.units for t in u.gathered)


def make_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)], nn.Linear(16, 1))


def check_21(rank: int, world_size: int, path: str) -> list[str]:
    exercise = load(path)
    reference = make_layers()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    model = exercise.Sharded(make_layers())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    watch = Watched(model.units)
    failures = []
    with Watch().active(*_loaded(exercise)) as collectives:
        for step in range(STEPS):
            failures = _step_21(model, opt, reference, ref_opt, watch, collectives, rank, world_size, step)
            if failures:
                break
    failures = failures or never_waited(collectives) or _cost_21(collectives, model.units, world_size)
    return gather_failures(failures)


def _loaded(exercise) -> list:
    """The learner's module and the exercise files it loaded (a solution built on another one): where a stub's
    collectives are bound to names of their own (``reduce_scatter = dist.reduce_scatter_tensor``)."""
    return [exercise] + [value for value in vars(exercise).values()
                         if isinstance(value, types.ModuleType) and value.__name__.startswith(EXERCISE_PREFIX)]


def _step_21(model, opt, reference, ref_opt, watch: Watched, collectives: Watch, rank: int,
             world_size: int, step: int) -> list[str]:
    """One step of the learner's sharded model beside the reference: [what went wrong], or []."""
    g = torch.Generator().manual_seed(100 + step)
    xs, ys = torch.randn(world_size, 8, 16, generator=g), torch.randn(world_size, 8, 1, generator=g)
    ref_opt.zero_grad()
    nn.functional.mse_loss(reference(xs.reshape(-1, 16)), ys.reshape(-1, 1)).backward()
    opt.zero_grad()
    watch.phase, watch.gathers, collectives.step = "forward", [], FORWARD
    saved = []  # every tensor autograd keeps for backward (ctx.save_for_backward's too)
    with Followed() as watch.followed:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = nn.functional.mse_loss(model(xs[rank]), ys[rank])
        copies = _full_copies(model, reference, saved, loss) if step == 0 and not watch.late else ""
        saved.clear()
        if copies:
            return [copies]
        watch.phase, collectives.step = "backward", BACKWARD
        loss.backward()
    watch.followed = None
    if watch.late:
        phase, index, held = watch.late[0]
        return [f"when unit {index} was gathered in {phase}, {held} bytes gathered earlier were still "
                f"held: free each unit's full parameters (free(full)) as soon as it has computed, and "
                f"do not keep them for backward: gather again there"]
    if watch.others:
        phase, index, alive = watch.others[0]
        return [f"when unit {index} was gathered in {phase}, {alive:,} bytes of tensors the size of a unit's full "
                f"parameters (a copy of them, or a full gradient) were still alive: at most one unit may be whole "
                f"at a time, the memory FSDP exists to save. Free what you gathered, and the full gradient, once "
                f"each has been used (free(tensor)), and keep neither on the unit, on ctx or in a global"]
    if watch.held():
        return [f"after backward {watch.held()} bytes of gathered parameters were still held: free "
                f"everything you gather"]
    not_again = [i for i in range(len(model.units)) if ("backward", i) not in watch.gathers]
    if not_again:
        return [f"backward never called unit.gather() for unit{'s' if len(not_again) > 1 else ''} "
                f"{', '.join(map(str, not_again))}: computing with full parameters kept from forward "
                f"(saved on ctx, or a copy of them) holds every unit in full from its forward to its "
                f"backward. Save only the input, and gather again in backward with unit.gather()"]
    empty = [i for i, u in enumerate(model.units) if u.shard.grad is None or not u.shard.grad.abs().sum()]
    if step == 0 and empty and worst(float(len(empty))) > 0:
        return [f"after backward the shard{'s' if len(empty) > 1 else ''} of unit{'s' if len(empty) > 1 else ''} "
                f"{', '.join(map(str, empty))} had no gradient (None or zeros): each unit's backward must return "
                f"the gradient for its input x too (the first of its outputs), or the units before it get none"]
    if step == 0 and world_size > 1 and worst(float(_local_only(model, reference, xs[rank], ys[rank], rank))):
        return ["the shards' gradients are this rank's own batch's, never averaged over the ranks: reduce-scatter "
                "the full gradient (every rank's sum of this rank's piece), then divide by the world size"]
    if step == 0 and world_size > 1:  # on one rank the sum is the average
        right = _refs(model, reference, rank)
        got = torch.cat([u.shard.grad for u in model.units])
        want = torch.cat([grad for _, grad in right])
        ratio = (got @ want / (want @ want)).item()
        if abs(ratio - world_size) < 1e-3 * world_size:
            return [f"the shards' gradients are {world_size}x the single-process ones: did you divide "
                    f"by the world size? (reduce-scatter sums)"]
        if abs(ratio - 1 / world_size) < 1e-3:
            return [f"the shards' gradients are 1/{world_size} of the single-process ones: did you "
                    f"divide by the world size twice?"]
    opt.step()
    ref_opt.step()
    if worst(float(any(u.shard.grad is not None and u.shard.grad.isnan().any() for u in model.units))):
        return [f"after backward a shard's gradient holds NaN: {READ_EARLY}"]
    gap = max((u.shard.detach() - w).abs().max().item()
              for u, (w, _) in zip(model.units, _refs(model, reference, rank)))
    if not worst(gap) <= 1e-5:  # NaN too
        return [f"after step {step + 1} the shards differ from one process on the whole batch by up to "
                f"{worst(gap):.2g}"]
    return []


def _full_copies(model, reference, saved: list, loss: torch.Tensor) -> str:
    """Between forward and backward: a live tensor (kept by Python, or saved for backward) that holds a unit's
    full parameters, or one of its layer's parameters whole. Each unit's own shard, and the grader's
    reference model, aside. Compared by value with the reference, which the learner's model equals here."""
    ours = {p.untyped_storage().data_ptr() for p in reference.parameters()}
    ours |= {u.shard.untyped_storage().data_ptr() for u in model.units}
    fulls = [torch.cat([p.detach().reshape(-1) for p in layer.parameters()]) for layer in reference]
    ours |= {f.untyped_storage().data_ptr() for f in fulls}
    wholes = [(i, p.detach()) for i, layer in enumerate(reference) for p in layer.parameters() if p.numel() > 1]
    found, seen = {}, set()
    kept = reachable_tensors(model, loss, modules=globals_of(model))
    for where, tensors in (("saved for backward", saved), ("kept by your objects", kept)):
        for t in tensors:
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in ours or storage.nbytes() == 0 or t.dtype != torch.float32 or \
                    (storage.data_ptr(), t.storage_offset(), t.numel()) in seen:
                continue
            seen.add((storage.data_ptr(), t.storage_offset(), t.numel()))
            flat = t.detach().reshape(-1)
            for i, full in enumerate(fulls):
                if flat.numel() >= full.numel() and torch.equal(flat[:full.numel()], full):
                    found.setdefault(i, (where, storage.nbytes()))
            for i, whole in wholes:
                if t.shape == whole.shape and torch.equal(t.detach(), whole):
                    found.setdefault(i, (where, storage.nbytes()))
    if not found:
        return ""
    units = sorted(found)
    kinds = sorted({where for where, _ in found.values()})
    total = sum(nbytes for _, nbytes in found.values())
    return (f"between forward and backward, a copy of the full parameters of unit{'s' if len(units) > 1 else ''} "
            f"{', '.join(map(str, units))} was still alive ({' and '.join(kinds)}; {total:,} bytes): every unit "
            f"is then held in full from its forward to its backward, the memory FSDP exists to save. Save only "
            f"the input, free what you gathered, and gather again in backward with unit.gather()")


# The phases of a step of exercise 21, as the collectives watch's step.
FORWARD, BACKWARD = 0, 1


def _cost_21(collectives: Watch, units, world_size: int) -> list[str]:
    """Bytes each rank moves per step, by phase, against the algorithm's: in forward one all-gather per unit
    (``unit.gather()``), in backward one more and one reduce-scatter of the unit's full gradient."""
    line = sum(world_size * unit.piece * 4 for unit in units)  # every unit's padded flat line, float32
    share = (world_size - 1) / world_size
    for phase, budget, what in ((FORWARD, share * line, "one all-gather per unit"),
                                (BACKWARD, 2 * share * line, "one all-gather and one reduce-scatter per unit")):
        cost = _phase_cost(collectives, phase, world_size)
        if cost.moved <= SLACK * budget:
            continue
        if phase == BACKWARD and cost.all_reduce:
            why = ("an all-reduce of the full gradient moves twice what a reduce-scatter moves, and this rank "
                   "keeps only its piece of the result: reduce-scatter the full gradient into this rank's piece")
        elif cost.wider:
            why = f"your collectives send {', '.join(cost.wider)}: send the float32 tensors as they are"
        else:
            why = (f"{cost.moved / budget:.1f}x that: gather each unit once per pass, and reduce-scatter its "
                   f"gradient once")
        return [f"in {'forward' if phase == FORWARD else 'backward'}, each rank moves {cost.moved:,.0f} bytes per "
                f"step over the network ({cost.names}), where {what} move {budget:,.0f}: {why}"]
    return []


def _local_only(model, reference, x, y, rank: int) -> bool:
    """Whether the shards hold this rank's piece of its own batch's gradient (the loss on x alone)."""
    mine = copy.deepcopy(reference)
    mine.zero_grad()
    nn.functional.mse_loss(mine(x), y).backward()
    want = torch.cat([grad for _, grad in _refs(model, mine, rank)])
    got = torch.cat([u.shard.grad for u in model.units])
    return got.shape == want.shape and torch.allclose(got, want, atol=1e-6, rtol=1e-4)


def _piece(unit, layer: nn.Module, rank: int):
    """This rank's piece of the layer's flat (weights, gradients), padded like the unit."""
    def cut(tensors):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        flat = nn.functional.pad(flat, (0, unit.piece * unit.world_size - unit.numel))
        return flat[rank * unit.piece:(rank + 1) * unit.piece]
    params = list(layer.parameters())
    return cut([p.detach() for p in params]), cut([p.grad for p in params])


def _refs(model, reference, rank):
    return [_piece(unit, layer, rank) for unit, layer in zip(model.units, reference)]
