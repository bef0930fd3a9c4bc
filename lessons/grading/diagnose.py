"""Name a wrong gradient: which of the usual mistakes gives, parameter by parameter, what the ranks hold.

Every rank can compute every rank's slice gradient (the grader's data is the
same everywhere), so for each parameter it can build what each kind of mistake
would leave in ``.grad`` -- this rank's own gradient, rank k's, the sum, the
element-wise largest, the average divided once more -- and see which one the
learner's ``.grad`` holds. A kind counts only if it matches on every rank (on
rank 0, "its own" and "rank 0's" are the same tensor; only rank 0's fits rank 1
too). The answer names the parameters that are right and those that are wrong.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ATOL, RTOL = 1e-5, 1e-4  # float32 sums of 3 slices against one process on the whole batch


def kinds(grad: torch.Tensor, slices: list[torch.Tensor], rank: int) -> set[str]:
    """The names of the kinds of result ``grad`` matches, given every rank's slice gradient."""
    p = len(slices)
    stacked = torch.stack(slices)
    mean = stacked.mean(dim=0)
    candidates = {
        "mean": mean,
        "own": slices[rank],
        "sum": mean * p,
        "divided twice": mean / p,
        "max": stacked.max(dim=0).values,
        "min": stacked.min(dim=0).values,
        "own divided": slices[rank] / p,
        "zero": torch.zeros_like(mean),
    }
    candidates.update({f"rank {k}'s": slices[k] for k in range(p)})
    found = {name for name, value in candidates.items()
             if grad.shape == value.shape and torch.allclose(grad, value, atol=ATOL, rtol=RTOL)}
    if not found and grad.shape == mean.shape and mean.abs().max() > 0:  # the sum divided by another number
        divisor = p / ((grad.double() * mean.double()).sum() / (mean.double() ** 2).sum()).item()
        if 0.5 < divisor < 64 and abs(divisor - round(divisor)) < 1e-3 and \
                torch.allclose(grad, mean * p / round(divisor), atol=ATOL, rtol=RTOL):
            found.add(f"sum divided by {round(divisor)}")
    return found


PRIORITY = ["mean", "own", "sum", "divided twice", "own divided", "max", "min", "zero"]


def what_each_holds(names: list[str], grads: list[torch.Tensor], slices: list[list[torch.Tensor]]) -> dict[str, str]:
    """{parameter name: the kind its .grad matches on every rank, or "?"}; the same dict on every rank."""
    rank, p = dist.get_rank(), dist.get_world_size()
    mine = [kinds(g, [s[i] for s in slices], rank) for i, g in enumerate(grads)]
    everyone = [None] * p
    dist.all_gather_object(everyone, mine)
    held = {}
    for i, name in enumerate(names):
        common = set.intersection(*(ranks_kinds[i] for ranks_kinds in everyone))
        ordered = [k for k in PRIORITY if k in common] + sorted(k for k in common if k not in PRIORITY)
        held[name] = ordered[0] if ordered else "?"
    return held


def describe(kind: str, p: int, ops: set[str]) -> str:
    """What a parameter holding ``kind`` shows, and what to do, in a learner's words."""
    if kind == "own":
        return (f"each rank's own slice's gradient, never averaged: after backward every .grad must hold the "
                f"average over the {p} ranks")
    if kind.startswith("rank "):
        return (f"{kind} own gradient on every rank: you sent (broadcast) one rank's gradient instead of averaging "
                f"them; sum every rank's (all_reduce, ReduceOp.SUM) and divide by {p}")
    if kind == "sum":
        return f"the sum over the ranks, {p}x the right ones: did you divide by the world size?"
    if kind == "divided twice":
        return f"1/{p} of the right ones: did you divide by the world size twice?"
    if kind.startswith("sum divided by "):
        q = kind.removeprefix("sum divided by ")
        return (f"the sum over the {p} ranks divided by {q}: divide by the number of ranks, "
                f"dist.get_world_size(), not by a number written into the code")
    if kind == "own divided" and "ASYNC" in ops:
        return (f"each rank's own gradient divided by {p}: the tensor was read (or divided) before its sum had "
                f"arrived. An async all-reduce's result is there only once its wait() has returned: wait first, "
                f"then divide")
    if kind == "own divided":
        return (f"each rank's own gradient divided by {p}: the sum over the ranks never reached .grad. An "
                f"all-reduce writes the sum into the very tensor it is given: if that was a copy (.clone(), "
                f"torch.cat of the gradients), copy the result back into .grad")
    if kind in ("max", "min"):
        op = "MAX" if kind == "max" else "MIN"
        called = f" (you called dist.all_reduce with op=ReduceOp.{op})" if op in ops else ""
        return (f"the element-wise {'largest' if kind == 'max' else 'smallest'} of the ranks' gradients{called}, "
                f"not their average: sum them (ReduceOp.SUM, the default) and divide by {p}")
    if kind == "zero":
        return "zero: the gradient was cleared or never written back"
    wrong_ops = sorted(o for o in ops - {"SUM", "ASYNC", "AVG", "BROADCAST"} if not o.startswith("AT "))
    if wrong_ops:
        return (f"none of the usual mistakes' values, and you called dist.all_reduce with "
                f"op=ReduceOp.{', ReduceOp.'.join(wrong_ops)}: the average is ReduceOp.SUM divided by {p}")
    return "not the average over the ranks (nor any one rank's gradient, nor their sum)"


def explain_gradients(held: dict[str, str], p: int, ops: set[str], step: int, error: float) -> str:
    """One sentence for the first wrong step: which parameters hold what, which are right."""
    when = f"on step {step + 1} (the steps before were right) " if step else ""
    site = next((o.removeprefix("AT ") for o in ops if o.startswith("AT ")), "")
    site = f" (all-reduced at {site})" if site else ""
    wrong = {}
    for name, kind in held.items():
        if kind != "mean":
            wrong.setdefault(kind, []).append(name)
    right = [name for name, kind in held.items() if kind == "mean"]
    if not wrong:  # every parameter within float tolerance of some right value, yet the bench saw an error
        return f"gradients {when}differ from one process on the whole batch by up to {error:.2g}"
    if len(wrong) == 1 and not right:
        kind = next(iter(wrong))
        return f"gradients{site} {when}are {describe(kind, p, ops)}"
    parts = [f"the gradients of {', '.join(names)} are {describe(kind, p, ops)}" for kind, names in wrong.items()]
    if right:
        parts.append(f"those of {', '.join(right)} are right")
    return f"{when}{'; '.join(parts)}{site}".strip()
