"""The grader's systematic checks, each against a planted mistake of a kind no file in ``_solutions/wrong`` holds.

Every planted solution is a right one (the reference) with one mistake put
in, or a short file of its own; each must fail with words that name its
mistake, and the right solutions (the references and ``_solutions/right``,
three or more per exercise, in ``test_exercises.py``) must pass the very same
checks. What each plants:

* world sizes: a world size written into the code passes at 3 ranks only;
* the ledger: a rank that calls a collective alone, ranks that call one with different sizes, and an
  exception on one rank are named, with the rank and the learner's line, in seconds (not by a Gloo timeout);
* the family of models: a parameter without a gradient in some step, a hook on a frozen parameter;
* counts across steps: hooks registered at every step pile up;
* memory from what the objects reach: a kept full copy, a view that keeps a whole line alive;
* the docstrings' promises: "bit for bit", the caller's input unchanged, the dtype returned;
* words: what a mistake is told never names another cause.
"""

import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lessons.grading.exercises import EXERCISES  # noqa: E402
from lessons.grading.runner import SOLUTIONS_DIR, grade, patience  # noqa: E402


def reference(number: str) -> str:
    return (SOLUTIONS_DIR / EXERCISES[number].file).read_text()


def planted(number: str, old: str, new: str) -> str:
    """The reference solution with ``old`` replaced by ``new`` (which must be there: a planted mistake is real)."""
    source = reference(number)
    assert old in source, f"the reference of {number} no longer has {old!r}"
    return source.replace(old, new)


HAND_04 = '''
import torch.distributed as dist


def broadcast_parameters(module):
    for p in module.parameters():
        {broadcast}


def average_gradients(module):
    for p in module.parameters():
        if {test}:
            {reduce}
'''


def hand_04(broadcast="dist.broadcast(p.data, src=0)", test="p.grad is not None",
            reduce="dist.all_reduce(p.grad)\n            p.grad /= dist.get_world_size()") -> str:
    return HAND_04.format(broadcast=broadcast, test=test, reduce=reduce)


# name: (exercise, source, words the first failure must contain, words it must not contain)
CASES = {
    # a world size written into the code: right at 3 ranks, wrong at 2 and 4
    "04_divides_by_3": ("04", hand_04(reduce="dist.all_reduce(p.grad)\n            p.grad /= 3"),
                        ["on 2 ranks", "divided by 3", "dist.get_world_size()"], []),
    "10_gathers_a_list_of_3": ("10", planted("10", "for _ in range(dist.get_world_size(group))]", "for _ in range(3)]"),
                               ["list of 3", "one per rank"], ["Connection reset"]),
    "03_ring_of_3": ("03", planted("03", "p, r = dist.get_world_size(group), dist.get_rank(group)",
                                   "p, r = 3, dist.get_rank(group)"),
                     ["on 2 ranks", "ring_of_3.py:"], ["Timed out", "Connection reset"]),
    # the group given: ignored, its numbers taken for the world's; the tensors of any layout
    "03_ignores_the_group": ("03", planted("03", "p, r = dist.get_world_size(group), dist.get_rank(group)",
                                           "p, r = dist.get_world_size(), dist.get_rank()").replace(
                                               "group=group, group_dst=", "dst=").replace("group=group, group_src=",
                                                                                          "src="),
                             ["on 4 ranks", "sum over all 4 ranks", "group=group"], []),
    "03_group_ranks_as_dst": ("03", planted("03", "group=group, group_dst=right)  #", "group=group, dst=right)  #"),
                              ["on 4 ranks", "group_ranks_as_dst.py:", "group_dst="], ["Timed out"]),
    "10_ignores_the_group": ("10", planted("10", "dist.all_gather(everyone, mine, group=group)",
                                           "dist.all_gather(everyone, mine)").replace(
                                               "range(dist.get_world_size(group))", "range(dist.get_world_size())"),
                             ["on 4 ranks", "over all 4 ranks", "group=group"], []),
    "10_counts_the_world": ("10", planted("10", "range(dist.get_world_size(group))", "range(dist.get_world_size())"),
                            ["on 4 ranks", "counts_the_world.py:", "dist.get_world_size(group)"],
                            ["Timed out", "Connection reset"]),
    "03_sums_into_a_strided_copy": ("03", planted("03", "out = x.clone(memory_format=torch.contiguous_format)",
                                                  "out = x.clone()"),
                                    ["on 3 ranks", "non-contiguous", "contiguous"], []),
    "03_chunks_by_torch_chunk": ("03", planted("03", "chunks = list(out.reshape(-1).tensor_split(p))",
                                               "chunks = list(out.reshape(-1).chunk(p))"),
                                 ["chunk", "tensor_split"], ["Timed out"]),
    # the ledger: a lone collective, different sizes, one rank raising
    "04_broadcasts_on_rank_0_only": ("04", hand_04(broadcast="if dist.get_rank() == 0:\n            "
                                                             "dist.broadcast(p.data, src=0)"),
                                     ["rank 0 called dist.broadcast", "never did", "broadcasts_on_rank_0_only.py:8",
                                      "if dist.get_rank() == 0"], ["Timed out", "waited for each other"]),
    "10_gathers_uneven_batches": ("10", '''
import torch
import torch.distributed as dist


def global_mean_and_var(x):
    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, x)
    var, mean = torch.var_mean(torch.cat(everyone), dim=0, correction=0)
    return mean, var
''', ["different sizes", "dist.all_gather", "gathers_uneven_batches.py:8"], ["Connection reset by peer:"]),
    "04_raises_on_rank_1": ("04", hand_04(test="dist.get_rank() != 1 or p.grad.nonexistent"),
                            ["AttributeError", "raises_on_rank_1.py:12", "rank 1 only"], ["Timed out"]),
    # the family: a trainable parameter with no gradient this step; a hook on a frozen parameter
    "04_skips_by_requires_grad": ("04", hand_04(test="p.requires_grad"), ["whose .grad is None"], []),
    "05_hooks_every_parameter": ("05", planted("05", "            if p.requires_grad:\n                p.register",
                                               "            if True:\n                p.register"),
                                 ["frozen parameter", "hooks_every_parameter.py:"], []),
    # the family's bfloat16 copy: each gradient sent in its own dtype
    "04_sums_in_float32": ("04", hand_04(reduce="total = p.grad.float()\n            dist.all_reduce(total)\n"
                                                "            p.grad.copy_(total / dist.get_world_size())"),
                           ["bfloat16 copy", "float32", "own dtype"], []),
    "07_float32_buckets": ("07", planted("07", "flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[self.next_bucket]])",
                                         "flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[self.next_bucket]])"
                                         ".float()"),
                           ["bfloat16 copy", "float32", "own dtype"], []),
    # counts across steps: hooks registered again at every forward
    "05_registers_at_every_forward": ("05", planted("05", "        return self.module(*args, **kwargs)",
                                                    "        self.register_hooks()\n"
                                                    "        return self.module(*args, **kwargs)"),
                                      ["registered", "during step", "pile up"], []),
    # memory from everything the objects reach
    "21_keeps_a_copy_and_gathers_again": ("21", planted(
        "21", "        out = unit.run(full, x)\n        free(full)",
        "        out = unit.run(full, x)\n        ctx.kept = full.clone()\n        free(full)"),
        ["a copy of the full parameters", "kept by your objects"], []),
    "19_keeps_the_line_in_a_view": ("19", planted(
        "19", "self.shard.grad = self.my_piece(torch.cat([p.grad.reshape(-1) for p in self.params])).clone()",
        "self.shard.grad = self.my_piece(torch.cat([p.grad.reshape(-1) for p in self.params]))"),
        ["self.shard.grad is a view", ".clone()"], []),
    "19_keeps_every_line_in_a_global": ("19", planted(
        "19", "        everyone = torch.empty(self.piece * self.world_size)",
        "        everyone = torch.empty(self.piece * self.world_size)\n        KEPT.append(everyone)")
        + "\n\nKEPT = []\n", ["grow"], []),
    # the peak of what a step makes: a full-size buffer per rank to gather into
    "19_gathers_a_line_per_rank": ("19", planted(
        "19", "        dist.all_gather(list(everyone.chunk(self.world_size)), self.shard.detach())",
        "        lines = [torch.zeros(self.piece * self.world_size) for _ in range(self.world_size)]\n"
        "        for line, mine in zip(lines, everyone.chunk(self.world_size)):\n"
        "            line[self.rank * self.piece:(self.rank + 1) * self.piece] = self.shard.detach()\n"
        "        dist.all_gather(list(everyone.chunk(self.world_size)), self.shard.detach())"),
        ["at its peak", "three lines"], []),
    "21_keeps_the_full_gradient": ("21", planted("21", "        free(grad_full)\n",
                                                 "        unit.last_gradient = grad_full\n"),
                                   ["when unit", "gathered in backward", "full gradient", "still alive"], []),
    # the docstrings' promises
    "19_one_ulp_off": ("19", planted("19", "                p.copy_(everyone[offset:offset + p.numel()].view_as(p))",
                                     "                p.copy_(everyone[offset:offset + p.numel()].view_as(p)"
                                     " * (1 + 2 ** -23))"),
                       ["bit for bit"], []),
    "10_centres_the_input_in_place": ("10", planted("10", "    mean = x.mean(dim=0)\n",
                                                    "    mean = x.mean(dim=0)\n    x -= 0 * mean + 1e-3\n"
                                                    "    mean = x.mean(dim=0) + 1e-3\n"),
                                      ["changed its input x"], []),
    "10_returns_float32": ("10", planted("10", "    return global_mean, global_m2 / total",
                                         "    return global_mean.float(), (global_m2 / total).float()"),
                           ["float64 batch", "float32"], []),
    # words: a synchronous all-reduce into a copy is not a race; a broadcast into a copy is not "nothing"
    "04_sums_a_copy": ("04", hand_04(reduce="total = p.grad.clone()\n            dist.all_reduce(total)\n"
                                            "            p.grad /= dist.get_world_size()"),
                       ["never reached .grad", "copy the result back"], ["wait"]),
    "04_broadcasts_a_copy": ("04", hand_04(broadcast="dist.broadcast(p.detach().clone(), src=0)"),
                             ["called dist.broadcast", "copy the result back"], ["nothing was broadcast"]),
}

# No first line of a failure may be what the transport, or the grader's own code, said.
NOT_FIRST = re.compile(r"Timed out|timed out after|Connection reset|Connection closed|lessons/grading/|check_\w+\.py:\d")


@pytest.mark.parametrize("name", list(CASES))
def test_a_planted_mistake_fails_with_words_that_name_it(name, ranks, tmp_path):
    number, source, words, never = CASES[name]
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    started = time.monotonic()
    failures = grade(EXERCISES[number], path, ranks(4))
    took = time.monotonic() - started
    assert failures, f"{name} passed the grader"
    first = failures[0]
    for word in words:
        assert word in first, f"{name}: expected {word!r} in the first failure, got {first!r}"
    for word in never:
        assert word not in first, f"{name}: {word!r} should not be in {first!r}"
    assert not NOT_FIRST.search(first), first
    # a lone or mismatched call is named by the ledger, long before any time limit would end the run
    assert took < EXERCISES[number].timeout_s * patience() * 4, f"{name} took {took:.0f} s"
