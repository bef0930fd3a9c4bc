"""Checks of exercises 03 (the ring all-reduce) and 10 (SyncBatchNorm's forward statistics)."""

from __future__ import annotations

import contextlib
import inspect
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lessons.grading import sizes
from lessons.grading.bench import gather_failures
from lessons.grading.ledger import own
from lessons.grading.runner import load

COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter"]
_all_reduce = own.all_reduce  # the grader's own, never watched


@contextlib.contextmanager
def watched_messages(used: set, sent: list):
    """Record the collectives called (in ``used``) and the numbers sent point to point (appended to ``sent``).

    Every send goes through ``distributed_c10d.isend`` (``dist.send`` calls it; so does
    ``batch_isend_irecv``, whose ``P2POp`` checks it is given that very function):
    one wrapper, put in both modules, counts each message once.
    """
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    isend = c10d.isend

    def collective(name):
        def call(*args, **kwargs):
            used.add(name)
            return originals[name](*args, **kwargs)
        return call

    def counted_isend(tensor, *args, **kwargs):
        sent.append(tensor.numel())
        return isend(tensor, *args, **kwargs)

    for name in originals:
        setattr(dist, name, collective(name))
    dist.isend = c10d.isend = counted_isend
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        dist.isend = c10d.isend = isend


SHAPES = [(12,), (7,), (4, 5), (2,), (1,)]  # divisible by 3 or not, 2-D, fewer numbers than ranks, one number


@dataclass(frozen=True)
class Case:
    """One tensor the ring must sum: its shape and dtype, whether it is a transposed (non-contiguous) view, and
    whether it is summed within this rank's pair of ranks (``sizes.pair_of``) rather than over every rank."""

    shape: tuple
    dtype: torch.dtype = torch.float32
    transposed: bool = False
    in_pairs: bool = False

    def tensor(self, rank: int) -> torch.Tensor:
        """This rank's tensor: float32 normals; for float16, whole numbers, which any order sums exactly."""
        generator = torch.Generator().manual_seed(10 * rank + len(self.shape))
        shape = self.shape[::-1] if self.transposed else self.shape
        if self.dtype == torch.float32:
            x = torch.randn(shape, generator=generator)
        else:
            x = torch.randint(-8, 8, shape, generator=generator).to(self.dtype)
        return x.t() if self.transposed else x

    def said(self) -> str:
        kind = "" if self.dtype == torch.float32 else f"{str(self.dtype).removeprefix('torch.')} "
        layout = "a transposed (non-contiguous) view" if self.transposed else f"a {kind}tensor"
        return f"{layout} of shape {tuple(self.shape)}"


CASES = ([Case(shape) for shape in SHAPES] + [Case((7,), torch.float16), Case((4, 5), transposed=True)]
         + [Case((7,), in_pairs=True)])  # a ring works for any dtype, layout and group


def ring_allowance(shape: tuple, p: int) -> int:
    """The most numbers one rank of a ring sends for a tensor of ``shape``, for the cuts the stub invites.

    A ring's rank sends every chunk but one in the reduce-scatter and every chunk
    but one other in the all-gather: 2 n less two chunks. With p chunks of n / p
    that is 2 (p - 1) n / p; ``tensor_split`` of the flat tensor, or along dim 0
    (lesson 03's cut), may leave smaller chunks, so the allowance is the largest
    over both cuts: 2 n less the two smallest chunks.
    """
    n = torch.Size(shape).numel()
    cuts = [[len(c) for c in torch.arange(n).tensor_split(p)],
            [len(c) * n // shape[0] for c in torch.arange(shape[0]).tensor_split(p)]]
    return max(2 * n - sum(sorted(sizes)[:2]) if p > 2 else n for sizes in cuts)


def check_03(rank: int, world_size: int, path: str) -> list[str]:
    exercise = load(path)
    failures = []
    for case in CASES:
        group = sizes.pair_of(rank) if case.in_pairs else None
        if case.in_pairs and group is None:
            continue  # pairs are graded at 4 ranks
        p = dist.get_world_size(group)
        x = case.tensor(rank)
        before = x.clone()
        used, sent = set(), []
        with watched_messages(used, sent):
            if case.in_pairs and not _takes_group(exercise.ring_all_reduce):
                failures.append(_no_group(exercise.ring_all_reduce, world_size))
                break
            result = exercise.ring_all_reduce(x, group) if case.in_pairs else exercise.ring_all_reduce(x)
        right, whole = x.clone(), x.clone()
        _all_reduce(right, group=group)
        _all_reduce(whole)  # over every rank: what a ring that ignores the group sums
        n, shape, dtype = x.numel(), case.shape, case.dtype
        if used:
            failures.append(f"you called dist.{', dist.'.join(sorted(used))}: the exercise builds the all-reduce "
                            f"from send and recv alone")
        if not torch.equal(x, before):
            failures.append("your function changed x: sum into a copy (x.clone()) and return that")
        if isinstance(result, tuple) and result and isinstance(result[0], torch.Tensor):
            failures.append(f"you returned a tuple of {len(result)}: return the summed tensor alone (lesson 03's "
                            f"function also returns the count it sent; the exercise's does not)")
            break
        if not isinstance(result, torch.Tensor) or result.shape != x.shape:
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            failures.append(f"for {case.said()} you returned {got}: return a tensor shaped like x")
            break
        kind, got = (str(t).removeprefix("torch.") for t in (dtype, result.dtype))
        if result.dtype != dtype:
            failures.append(f"for a {kind} tensor you returned a {got} one: return x's dtype (build the result "
                            f"from x.clone(), and buffers with torch.empty_like)")
            break
        if not torch.allclose(result, right, atol=1e-5):
            failures.append(_not_the_sum(case, result, before, whole, rank))
        if failures[-1:] == [WRONG_CHUNKS] and p != world_size:
            failures[-1] = f"for {case.said()} summed within {_pair_said(rank)}, this rank's result is not the sum"
        chunks = _chunk_kinds(result, case, p) if WRONG_CHUNKS in failures else None
        everyone = [None] * world_size
        dist.all_gather_object(everyone, (sum(sent), chunks))  # every rank, whatever it found
        if WRONG_CHUNKS in failures:
            failures[failures.index(WRONG_CHUNKS)] = _wrong_chunks([kinds for _, kinds in everyone], n, rank, p,
                                                                   [count for count, _ in everyone])
        everyone = [count for count, _ in everyone]
        allowed = ring_allowance(shape, p)
        if not used and not failures and max(everyone) > allowed:
            failures.append(f"for {case.said()} ({n} numbers) the ranks sent {everyone} numbers: a ring of {p} "
                            f"sends at most {allowed} per rank here (2 (p - 1) of the p chunks tensor_split "
                            f"cuts, about 2 (p - 1) / p of the tensor); sending whole tensors, or everything to one "
                            f"rank (a parameter server), sends more")
        if gather_failures(failures):
            break
    return gather_failures(failures)


def _takes_group(function) -> bool:
    """Whether ``function(x, group)`` is a call its signature accepts."""
    try:
        inspect.signature(function).bind(None, None)
    except TypeError:
        return False
    return True


def _no_group(function, world_size: int) -> str:
    name = function.__name__
    return (f"your {name} takes no group, and at {world_size} ranks the grader gives it one of two groups of 2 to "
            f"work within: keep the stub's signature, {name}(x, group=None)")


def _pair_said(rank: int) -> str:
    ranks = dist.get_process_group_ranks(sizes.pair_of(rank))
    return f"the group given (ranks {' and '.join(map(str, ranks))})"


def _not_the_sum(case: Case, result: torch.Tensor, before: torch.Tensor, whole: torch.Tensor, rank: int) -> str:
    """What a result that is not the sum is instead, where that shows the mistake (``whole``: the sum over every
    rank)."""
    if case.in_pairs:
        if torch.allclose(result, whole, atol=1e-5):
            return (f"for {case.said()} summed within {_pair_said(rank)} your result is the sum over all "
                    f"{dist.get_world_size()} ranks: the sum is over the ranks of `group` only. Number the ranks "
                    f"within it (dist.get_rank(group), dist.get_world_size(group)) and pass group=group to every "
                    f"send and recv")
    if case.dtype != torch.float32:
        kind = str(case.dtype).removeprefix("torch.")
        return (f"for {case.said()} the result is not the sum (for float32 ones it is): did you receive into "
                f"buffers made by torch.empty(size) or torch.zeros(n)? Those are float32 whatever x is, while the "
                f"numbers that arrive are {kind}. Make each buffer like its chunk: torch.empty_like(chunk)")
    if torch.allclose(result, before):
        if case.transposed:
            return (f"for {case.said()} the result is this rank's own x (for contiguous ones it is the sum): "
                    f"reshape(-1) of a non-contiguous tensor is a copy, so the chunks you summed into were not your "
                    f"result's. Make the result contiguous first (x.contiguous().clone(), or "
                    f"x.clone(memory_format=torch.contiguous_format))")
        return f"for {case.said()} the result is this rank's own x: nothing was added"
    return WRONG_CHUNKS  # told apart below, with every rank's chunks


WRONG_CHUNKS = "<chunks not the sum>"  # a placeholder until every rank's chunks are known


def _chunk_kinds(result: torch.Tensor, case: Case, p: int) -> list[str]:
    """What each chunk of this rank's result holds: "sum", "sum of j" (chunk j's finished sum), "partial" (the sum
    of some but not all ranks' pieces of it), or "?". Every rank's x is the grader's ``Case.tensor``, known to all."""
    pieces = [case.tensor(k).reshape(-1).tensor_split(p) for k in range(p)]
    sums = [sum(pieces[k][c] for k in range(p)) for c in range(p)]
    kinds = []
    for c, got in enumerate(result.reshape(-1).tensor_split(p)):
        same = lambda a: a.shape == got.shape and torch.allclose(got, a, atol=1e-5)  # noqa: E731
        partial = any(same(sum(pieces[k][c] for k in ranks))
                      for size in range(1, p) for ranks in itertools.combinations(range(p), size))
        other = next((j for j in range(p) if j != c and same(sums[j])), None)
        kinds.append("sum" if same(sums[c]) else f"sum of {other}" if other is not None else
                     "partial" if partial else "?")
    return kinds


def _wrong_chunks(everyone: list, n: int, rank: int, p: int, sent: list) -> str:
    """Which ring mistake the chunks show, told apart by what they hold on every rank (None: that rank's are right)
    and by the numbers each rank sent."""
    everyone = [kinds or ["sum"] * p for kinds in everyone]
    wrong = [c for c, kind in enumerate(everyone[rank]) if kind != "sum"]
    misplaced = [(r, c, kind.removeprefix("sum of ")) for r, kinds in enumerate(everyone)
                 for c, kind in enumerate(kinds) if kind.startswith("sum of ")]
    if misplaced:
        r, c, j = misplaced[0]
        return (f"for a tensor of {n} numbers rank {r}'s chunk {c} holds the finished sum of chunk {j}: the all-gather "
                f"stored a chunk where chunk {c} belongs. At all-gather step s rank r receives chunk (r - s) mod p, "
                f"the one its left neighbour just finished or received: receive it into that same chunk")
    finished = any(kind == "sum" for kinds in everyone for kind in kinds)
    whole_ring = min(sent) >= 2 * (p - 1) * (n // p)  # every rank sent 2 (p - 1) chunks: no step was left out
    if not finished and all(kind == "partial" for kinds in everyone for kind in kinds) and whole_ring:
        return (f"for a tensor of {n} numbers no rank ends with any chunk summed over all {p} ranks, though every "
                f"rank sent 2 (p - 1) chunks: the all-gather passed on chunks that were not finished, over the "
                f"finished ones. After the reduce-scatter rank r holds the finished chunk (r + 1) mod p: at "
                f"all-gather step s it sends chunk (r + 1 - s) mod p and receives chunk (r - s) mod p")
    if not finished and all(kind == "partial" for kinds in everyone for kind in kinds):
        return (f"for a tensor of {n} numbers no rank ends with any chunk summed over all {p} ranks, each holds "
                f"the sum of only some ranks' pieces: the reduce-scatter stopped a step early. It takes p - 1 = "
                f"{p - 1} steps, each adding the chunk received, before rank r's chunk (r + 1) mod p is finished")
    return (f"for a tensor of {n} numbers rank {rank}'s chunks {wrong} (of {p}) are not the sum: after the "
            f"reduce-scatter rank r holds the finished chunk (r + 1) mod p, and the all-gather must hand every "
            f"finished chunk to every rank")


def _pair_failures(mean, var, batches: list, rank: int) -> list[str]:
    """Statistics over this rank's pair (``sizes.pair_of``), not over every rank."""
    members = dist.get_process_group_ranks(sizes.pair_of(rank))
    right_var, right_mean = torch.var_mean(torch.cat([batches[m] for m in members]), dim=0, correction=0)
    if _right((mean, var), right_mean, right_var):
        return []
    every_var, every_mean = torch.var_mean(torch.cat(batches), dim=0, correction=0)
    given = f"the group given (ranks {' and '.join(map(str, members))})"
    if _right((mean, var), every_mean, every_var):
        return [f"for {given} your statistics are over all {len(batches)} ranks' samples: they are over the ranks "
                f"of `group` only. Pass group=group to every collective, and count its ranks with "
                f"dist.get_world_size(group)"]
    off = max((mean.double() - right_mean.double()).abs().max().item(),
              (var.double() - right_var.double()).abs().max().item())
    return [f"for {given} the statistics are off by up to {off:.3g} from its samples' (right over every rank): "
            f"pass group=group to every collective, and count its ranks with dist.get_world_size(group)"]


def _right(returned, right_mean: torch.Tensor, right_var: torch.Tensor) -> bool:
    return returned is not None and close(returned[0], right_mean) and close(returned[1], right_var)


def close(mine: torch.Tensor, right: torch.Tensor) -> bool:
    """Equal within float32 rounding; statistics computed in float64 (say) are as right as float32 ones."""
    return mine.shape == right.shape and torch.allclose(mine.to(right.dtype), right, rtol=1e-4, atol=1e-4)


# A common shift large against the data's spread: float32 keeps about 7 digits, so E[x^2] - E[x]^2 loses the
# variance (of order 1) to rounding of numbers of order SHIFT^2.
SHIFT = 1e4


def check_10(rank: int, world_size: int, path: str) -> list[str]:
    exercise = load(path)
    failures = gather_failures(_check_10(exercise, rank, world_size, shift=0.0))
    # The docstring's other promises: any (n, C) batch -- one sample on a rank, a non-contiguous view,
    # float64 -- in x's dtype, and x left as it was. Every rank goes on to the next case together.
    for case in ({"shift": SHIFT}, {"shift": 0.0, "first": 1}, {"shift": 0.0, "transposed": True},
                 {"shift": 0.0, "dtype": torch.float64}, {"shift": 0.0, "in_pairs": True}):
        if failures:
            break
        if case.get("in_pairs") and sizes.pair_of(rank) is None:
            continue  # pairs are graded at 4 ranks
        if case.get("in_pairs") and not _takes_group(exercise.global_mean_and_var):
            failures = [_no_group(exercise.global_mean_and_var, world_size)]
            break
        failures = gather_failures(_check_10(exercise, rank, world_size, **case))
    return failures


def _check_10(exercise, rank: int, world_size: int, shift: float, first: int = 2, transposed: bool = False,
              dtype: torch.dtype = torch.float32, in_pairs: bool = False) -> list[str]:
    """The statistics of every rank's batch together (sizes ``first``, + 3, + 6...), each rank's shifted by 3 r,
    plus ``shift``; ``transposed``: x is a non-contiguous view; ``in_pairs``: over this rank's pair only."""
    channels = 4
    batches = [(torch.randn(first + 3 * r, channels, generator=torch.Generator().manual_seed(r)) * (1 + r) + 3 * r
                + shift).to(dtype) for r in range(world_size)]  # every rank makes every rank's batch, for the reference
    x = batches[rank].t().contiguous().t() if transposed else batches[rank].clone()
    before = x.clone()
    group = sizes.pair_of(rank) if in_pairs else None
    mean, var = exercise.global_mean_and_var(x, group) if in_pairs else exercise.global_mean_and_var(x)
    tensors = isinstance(mean, torch.Tensor) and isinstance(var, torch.Tensor)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (mean, var) if tensors else None)  # every rank, whatever it returned
    case = (f"for a batch of {len(x)} sample{'s' if len(x) > 1 else ''} on rank 0" if first != 2 else
            "for a non-contiguous batch (a transposed view)" if transposed else
            f"for a {str(dtype).removeprefix('torch.')} batch" if dtype != torch.float32 else "")
    if not torch.equal(x, before):
        return [f"your function changed its input x{' ' + case if case else ''}: the caller's batch must be left "
                f"as it was (compute on a copy, or out of place)"]
    if isinstance(mean, torch.Tensor) and isinstance(var, torch.Tensor) and (mean.dtype, var.dtype) != (x.dtype,) * 2:
        return [f"for a {str(x.dtype).removeprefix('torch.')} batch you returned "
                f"{str(mean.dtype).removeprefix('torch.')} and {str(var.dtype).removeprefix('torch.')} statistics: "
                f"return them in x's dtype (compute in float64 if you like, then .to(x.dtype)), or BatchNorm turns "
                f"the batch it normalizes into another dtype"]
    if in_pairs:
        return _pair_failures(mean, var, batches, rank)
    if shift:
        whole = torch.cat(batches).double()
        right_var, right_mean = torch.var_mean(whole, dim=0, correction=0)
        if not torch.allclose(mean.double(), right_mean, rtol=1e-6, atol=0) or \
                not torch.allclose(var.double(), right_var, rtol=1e-3, atol=1e-3):
            return [f"with every sample shifted by {shift:g} (a mean large against the spread) the variance is off "
                    f"by up to {(var.double() - right_var).abs().max():.3g} (it is about {right_var.mean():.3g}): "
                    f"E[x^2] - E[x]^2 subtracts two numbers near {shift ** 2:g}, and in float32 they cancel "
                    f"catastrophically. Combine each rank's count, mean and M2 (lesson 10), or sum in float64"]
        return []
    whole = torch.cat(batches)
    right_var, right_mean = torch.var_mean(whole, dim=0, correction=0)
    failures = []
    if case and isinstance(mean, torch.Tensor) and isinstance(var, torch.Tensor) and \
            mean.shape == var.shape == (channels,) and not (close(mean, right_mean) and close(var, right_var)):
        off = max((mean.double() - right_mean.double()).abs().max().item(),
                  (var.double() - right_var.double()).abs().max().item())
        return [f"{case} the statistics are off by up to {off:.3g} from the whole batch's (right for float32 "
                f"batches of 2 or more samples)"]
    if not (isinstance(mean, torch.Tensor) and isinstance(var, torch.Tensor)) or mean.shape != (channels,) or var.shape != (channels,):
        failures.append(f"return two tensors of shape ({channels},): one mean and one variance per channel")
    elif _right(everyone[0], right_mean, right_var) and not all(_right(e, right_mean, right_var) for e in everyone):
        others = [r for r, e in enumerate(everyone) if not _right(e, right_mean, right_var)]
        failures.append(f"only rank 0 returned the whole batch's statistics (rank{'s' if len(others) > 1 else ''} "
                        f"{', '.join(map(str, others))} did not): every rank must return them. dist.reduce leaves "
                        f"the result on its dst alone: all_reduce instead, or broadcast the result from rank 0")
    elif close(mean, x.mean(dim=0)) and not close(mean, right_mean):
        failures.append("your statistics are this rank's own batch's: they must be the whole batch's, every rank's "
                        "samples together (gather each rank's count, mean and M2)")
    elif not close(mean, right_mean):
        unweighted = torch.stack([b.mean(dim=0) for b in batches]).mean(dim=0)
        if close(mean, unweighted):
            failures.append("your mean is the average of the ranks' means: right only when every rank has as many "
                            "samples; here they have " + ", ".join(str(len(b)) for b in batches)
                            + ": weight each rank's mean by its count")
        elif close(mean, whole.sum(dim=0) / (len(x) * world_size)):
            failures.append(f"your mean divides the sum by this rank's count times the number of ranks, as if every "
                            f"rank had as many samples; here they have "
                            + ", ".join(str(len(b)) for b in batches) + ": sum the ranks' counts")
        else:
            failures.append(f"the mean is off by up to {(mean - right_mean).abs().max():.3g} from the whole batch's")
    elif not close(var, right_var):
        n = whole.shape[0]
        local_vars = torch.stack([b.var(dim=0, correction=0) for b in batches])
        counts = torch.tensor([len(b) for b in batches], dtype=torch.float32)[:, None]
        if close(var, right_var * n / (n - 1)):
            failures.append("your variance is the unbiased one (divided by n - 1): BatchNorm normalizes with the "
                            "biased variance, divided by the total count n")
        elif close(var, local_vars.mean(dim=0)) or close(var, (counts * local_vars).sum(dim=0) / n):
            failures.append("your variance averages the ranks' variances: that misses the spread between the ranks' "
                            "means. Add, for each rank, its count times (its mean - the global mean) squared")
        elif len(whole) > len(batches) and close(var, (sum(b.var(dim=0) * len(b) for b in batches) + sum(
                len(b) * (b.mean(dim=0) - right_mean) ** 2 for b in batches)) / n):
            failures.append("each rank's M2 (sum of squared deviations) was computed from the unbiased variance "
                            "(torch.var divides by n - 1 unless correction=0): M2 is the plain sum of (x - mean)^2, "
                            "or the biased variance times n")
        else:
            failures.append(f"the variance is off by up to {(var - right_var).abs().max():.3g} from the whole batch's")
    if failures and len({repr(e) for e in everyone}) > 1:
        failures[0] += " (and the ranks returned different statistics: every rank must return the same ones)"
    if not failures and not all(e is not None and torch.equal(e[0], mean) and torch.equal(e[1], var)
                                for e in everyone):
        failures.append("the ranks returned different statistics: every rank must normalize with the same ones")
    return failures
