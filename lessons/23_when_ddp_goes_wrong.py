"""Lesson 23: when DDP goes wrong -- the ten failures people search for, made to happen, explained, fixed.

What you will learn
    Most people meet DDP's insides when something breaks. The same ten
    problems come back again and again in the issue trackers of pytorch,
    Lightning, accelerate and transformers. Each one here is made to happen
    on purpose, on two CPU ranks, once with torch's
    ``DistributedDataParallel`` and once with ``minddp.MiniDDP``; each rank's
    first line of the error is printed as the library raised it in this run,
    then why it happens, then the fixed run. A hang becomes an error: the
    broken runs use a process group with a short timeout (``--timeout-s``;
    torch's default is 30 minutes for Gloo, which is why a real one looks
    like a frozen job). ``docs/troubleshooting.md`` lists each message with
    the command that reproduces it.

     1. ``unused-parameter``: a layer no forward uses. torch fails at the
        *next* forward ("Expected to have finished reduction in the prior
        iteration ...", pytorch/pytorch#22436); MiniDDP at the end of the
        backward itself, naming the parameters, the rank and the step. And the
        twin: ``find_unused_parameters=True`` with nothing unused warns.
     2. ``mismatched-collectives``: an evaluation with a ``barrier()`` on rank
        0 only (pytorch/pytorch#54059, huggingface/accelerate#3380): both
        ranks wait for a partner that is in another collective.
        ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` names both ranks' collectives.
     3. ``accumulation``: ``no_sync()`` on the wrong micro-batch, the loss not
        divided by the micro-batches, ``static_graph=True`` with ``no_sync()``
        (pytorch/pytorch#43201, huggingface/accelerate#3679).
     4. ``rendezvous``: "address already in use", each rank its own
        ``MASTER_PORT``, a world size that never fills (pytorch/pytorch#126510,
        #53395).
     5. ``reentrant-checkpoint``: ``checkpoint(use_reentrant=True)`` with
        ``find_unused_parameters=True``: "Expected to mark a variable ready
        only once" (huggingface/accelerate#3536).
     6. ``slow``: DDP slower than one process: a tiny model whose step is all
        communication; tiny buckets; ``find_unused_parameters`` left on
        (pytorch/pytorch#73600). Counted, not timed.
     7. ``checkpoints``: the ``module.`` prefix, every rank writing the same
        file, ``map_location`` (pytorch/examples#969).
     8. ``sampler``: ``set_epoch`` never called (pytorch/pytorch#31771), and
        the padding that counts some samples twice in an evaluation.
     9. ``uneven-inputs``: one rank with a batch more hangs at the epoch's end
        (pytorch/pytorch#33148); ``join()``.
    10. ``sync-batchnorm``: an evaluation on rank 0 only, in training mode,
        waits for the other ranks' statistics; torch's ``SyncBatchNorm``
        refuses CPU input (pytorch/pytorch#48988), minddp's runs.

What to run
    python lessons/23_when_ddp_goes_wrong.py [--failure NAME] [--timeout-s 2] [--world-size 3]

    Without ``--failure`` all ten run, one after the other. It needs two
    ranks at least (one to fail, one to wait) and says so in one line when
    given ``--world-size 1``.

What to look at
    Under each failure: ``torch's DDP`` and ``MiniDDP``, a line per rank,
    each the first line of what that rank raised (or printed); ``why``; and
    ``fixed``, the run that works.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. ``--failure unused-parameter``: on which step does each wrapper
       raise, and which of the two names the layer?
    2. ``--failure uneven-inputs``: which rank raises, and what does the
       other rank do meanwhile?
    3. ``--failure accumulation``: dividing the loss by the number of
       micro-batches, how far are the gradients from one big batch's, and
       without dividing?
"""

import contextlib
import datetime
import os
import re
import tempfile
import textwrap
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import minddp.sampler
from minddp import MiniDDP
from minddp.ddp.replicas import ReplicaDesyncError
from minddp.launch import find_free_port
from minddp_lab.network import PRESETS
from minddp.sync_batchnorm import SyncBatchNorm
from _common import CountCollectives, c_stderr, parse_args, print0, run, short_group

WRAPPERS = {"torch's DDP": DistributedDataParallel, "MiniDDP": MiniDDP}


class Net(nn.Module):
    """A small model; ``extra`` only in the forwards that ask for it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.extra = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x, use_extra: bool = True):
        h = torch.relu(self.body(x))
        return self.head(h) + (self.extra(h) if use_extra else 0)


def batches(n: int) -> list[torch.Tensor]:
    """``n`` batches of this rank's own."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    return [torch.randn(4, 8, generator=gen) for _ in range(n)]


# ------------------------------------------------------------ showing what happened
def first_line(error: BaseException) -> str:
    """The error's first line, as raised (Gloo's source location before it left out)."""
    text = str(error).strip() or type(error).__name__
    return f"{type(error).__name__}: " + re.sub(r"^\[[^\]]*\.cc:\d+\] ", "", text.splitlines()[0])


def outcome(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 -- every error is what this lesson shows
        return first_line(error)
    return "no error"


def everyone(text: str) -> list[str]:
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, text)
    return lines


def show(label: str, fn) -> list[str]:
    """Run ``fn`` on every rank; rank 0 prints each rank's outcome (wrapped, whole); everyone's."""
    said = everyone(outcome(fn))
    print0(f"   {label}:")
    for rank, line in enumerate(said):
        print0(textwrap.fill(line, width=110, initial_indent=f"     [rank {rank}] ", subsequent_indent=" " * 14))
    return said


def why(text: str) -> None:
    print0(textwrap.fill(text, width=110, initial_indent="   why: ", subsequent_indent=" " * 8))


def fixed(text: str) -> None:
    print0(textwrap.fill(text, width=110, initial_indent="   fixed: ", subsequent_indent=" " * 10))


def header(number: int, title: str) -> None:
    print0(f"\n{number}. {title}")


def everyone_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return gathered


def same_everywhere(tensors) -> bool:
    """Are these tensors bit-identical on every rank?"""
    gathered = everyone_tensors(torch.cat([t.detach().flatten() for t in tensors]))
    return all(torch.equal(gathered[0], g) for g in gathered)


# ------------------------------------------------------------------- the failures
def unused_parameter(rank: int, timeout_s: float) -> None:
    header(1, "an unused parameter: no forward uses the layer 'extra' (pytorch/pytorch#22436)")
    x = batches(1)[0]
    said = {}
    for label, wrapper in WRAPPERS.items():
        model = wrapper(Net())

        def two_steps():
            for _ in range(2):
                model(x, use_extra=False).sum().backward()

        said[label] = show(f"{label}, two steps", two_steps)
    assert all("Expected to have finished reduction" in s for s in said["torch's DDP"]), said
    assert all("extra.weight" in s and f"rank {r}" in s for r, s in enumerate(said["MiniDDP"])), said
    # torch says which parameters only in the error's later lines, and by name only with a debug level:
    dist.set_debug_level(dist.DebugLevel.INFO)
    model = DistributedDataParallel(Net())
    dist.set_debug_level(dist.DebugLevel.OFF)
    model(x, use_extra=False).sum().backward()
    try:
        model(x, use_extra=False)
        raise AssertionError("torch's DDP did not raise at the second forward")
    except RuntimeError as error:
        named = [line.strip() for line in str(error).splitlines() if "did not receive grad" in line]
    print0(f"   torch with TORCH_DISTRIBUTED_DEBUG=INFO, further down its message: {named[0][:100]}")
    assert "extra.weight" in named[0], named
    why("the unused layer's gradients never arrive, so its bucket is never complete and never sent. torch finds "
        "out at the next forward (the bucket still waits); MiniDDP at the end of the backward, where it can name "
        "the parameters, the rank and the step.")

    # The twin: the flag on, and nothing unused.
    print0("   and its twin, find_unused_parameters=True when the forward uses every parameter:")
    theirs = DistributedDataParallel(Net(), find_unused_parameters=True)  # (kept: its backward holds a weak reference)
    torch_said = c_stderr(lambda: theirs(x).sum().backward())
    torch_warning = next(line for line in torch_said.splitlines() if "find_unused_parameters=True" in line)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mine = MiniDDP(Net(), find_unused_parameters=True)
        mine(x).sum().backward()
    ours = [str(w.message) for w in caught if "find_unused_parameters" in str(w.message)]
    print0(textwrap.fill(f"torch's DDP: {re.sub(r'^.*Warning: ', '', torch_warning)}", 110,
                         initial_indent="     ", subsequent_indent=" " * 7))
    print0(textwrap.fill(f"MiniDDP: {ours[0] if ours else 'no warning'}", 110, initial_indent="     ",
                         subsequent_indent=" " * 7))
    assert ours and f"rank {rank}" in ours[0], ours

    grads = []
    for wrapper in WRAPPERS.values():
        model = wrapper(Net(), find_unused_parameters=True)
        for _ in range(2):
            model(x, use_extra=False).sum().backward()
        grads.append([model.module.body.weight.grad, model.module.extra.weight.grad])
    fixed("find_unused_parameters=True when a forward may skip a layer (or take the layer out of the model): "
          f"two steps each, no error; body's gradients agree between the two wrappers: "
          f"{torch.allclose(grads[0][0], grads[1][0])}; extra's stay None in both: "
          f"{grads[0][1] is grads[1][1] is None}")
    assert torch.allclose(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-6) and grads[0][1] is grads[1][1] is None


def mismatched_collectives(rank: int, timeout_s: float) -> None:
    header(2, "collectives that differ across ranks: an evaluation with a barrier() on rank 0 only "
              "(pytorch/pytorch#54059, huggingface/accelerate#3380)")
    x = batches(1)[0]

    def step_evaluate_step(model, group, evaluating_ranks):
        def go():
            model(x).sum().backward()
            if rank in evaluating_ranks:  # evaluate, then wait for the others
                dist.barrier(group=group)
            model(x).sum().backward()
        return go

    said = {}
    for label, wrapper in WRAPPERS.items():
        group = short_group(timeout_s)
        said[label] = show(label, step_evaluate_step(wrapper(Net(), process_group=group), group, {0}))
    for ours in said.values():  # the first rank to give up closes its connections: the other may read that
        assert "no error" not in ours and any("timed out" in s.lower() for s in ours), said
    assert "bucket" in said["MiniDDP"][1] or "closed" in said["MiniDDP"][1], said["MiniDDP"]
    # The same run on a group made while torch's debug level is DETAIL: a wrapper around the group
    # compares every collective's fingerprint across ranks first, so the mismatch is named at once.
    dist.barrier()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    dist.set_debug_level(dist.DebugLevel.OFF)
    detail = show("MiniDDP on a group made under TORCH_DISTRIBUTED_DEBUG=DETAIL",
                  step_evaluate_step(MiniDDP(Net(), process_group=group), group, {0}))
    assert all("Detected mismatch between collectives" in s for s in detail), detail
    why("a collective returns when every rank of the group has called it. Rank 0's barrier waits for a barrier "
        "rank 1 never calls, while rank 1's gradient all-reduce waits for rank 0's: both wait until the timeout "
        "(torch's default for Gloo: 30 minutes); the first to give up closes its connections, and the other may "
        "report that instead. DETAIL checks each collective's kind and shapes across ranks first, and says which.")
    outcomes = []
    for wrapper in WRAPPERS.values():
        group = short_group(timeout_s)
        outcomes.append(outcome(step_evaluate_step(wrapper(Net(), process_group=group), group,
                                                   set(range(dist.get_world_size())))))
    fixed(f"every rank calls the evaluation's collectives (or none does): torch's DDP: {outcomes[0]}; "
          f"MiniDDP: {outcomes[1]}")
    assert outcomes == ["no error", "no error"], outcomes


def accumulation(rank: int, timeout_s: float) -> None:
    header(3, "gradient accumulation done wrong (pytorch/pytorch#43201, huggingface/accelerate#3679)")
    micro = batches(2)
    whole = torch.cat(everyone_tensors(torch.cat(micro)))  # the big batch: every rank's micro-batches

    def big_batch_grad():
        model = Net()
        model(whole).mean().backward()
        return model.body.weight.grad

    def accumulate(wrapper, sync_on, divide=True, **kwargs):
        model = wrapper(Net(), **kwargs)
        for i, x in enumerate(micro):
            with (contextlib.nullcontext() if i == sync_on else model.no_sync()):
                loss = model(x).mean()
                (loss / len(micro) if divide else loss).backward()
        return model

    print0("   a. no_sync() on the wrong micro-batch: the first synchronizes, the last accumulates alone")
    apart = {}
    for label, wrapper in WRAPPERS.items():
        model = accumulate(wrapper, sync_on=0)
        apart[label] = not same_everywhere([model.module.body.weight.grad])
        print0(f"     {label}: ranks' gradients differ after the step: {apart[label]} (nothing raised)")
    assert all(apart.values()), apart
    model = accumulate(MiniDDP, sync_on=0, check_sync_every=1)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    said = show("MiniDDP(check_sync_every=1), at the next forward", lambda: model(micro[0]))
    assert all(ReplicaDesyncError.__name__ in s and "body." in s for s in said), said

    print0("   b. the loss not divided by the number of micro-batches")
    reference = big_batch_grad()
    ratios = {}
    for label, wrapper in WRAPPERS.items():
        for divide in (True, False):
            grad = accumulate(wrapper, sync_on=len(micro) - 1, divide=divide).module.body.weight.grad
            ratios[label, divide] = (grad.norm() / reference.norm()).item()
        print0(f"     {label}: |accumulated grad| / |big batch's|: divided {ratios[label, True]:.4f}, "
               f"not divided {ratios[label, False]:.4f}")
    for label in WRAPPERS:
        assert abs(ratios[label, True] - 1) < 1e-5 and abs(ratios[label, False] - len(micro)) < 1e-4, ratios

    print0("   c. static_graph=True with no_sync()")
    said = {}
    for label, wrapper in WRAPPERS.items():
        def steps(wrapper=wrapper):
            for _ in range(2):
                accumulate(wrapper, sync_on=len(micro) - 1, static_graph=True)
        said[label] = show(label, steps)
    static = accumulate(MiniDDP, sync_on=len(micro) - 1, static_graph=True).module.body.weight.grad
    plain = accumulate(MiniDDP, sync_on=len(micro) - 1).module.body.weight.grad
    assert all("INTERNAL ASSERT" in s for s in said["torch's DDP"]), said  # torch 2.15
    assert all(s == "no error" for s in said["MiniDDP"]) and torch.equal(static, plain), said
    why("no_sync() is read at forward: the micro-batch that synchronizes must be the last, or the later ones "
        "stay local and the replicas drift (nothing raises; MiniDDP's check_sync_every names the tensor). The "
        "mean over k micro-batches is the big batch's mean only when each loss is divided by k. torch's static_graph "
        "counts hooks per iteration, and a no_sync() backward breaks its count (an internal assert, torch 2.15).")
    fixed("synchronize on the last micro-batch and divide each loss by k (a. and b. above: ratio 1); "
          f"MiniDDP's static_graph with no_sync() accumulates what the plain one does: {torch.equal(static, plain)}; "
          "with torch's, leave static_graph off when accumulating with no_sync().")


def rendezvous(rank: int, timeout_s: float) -> None:
    header(4, "launch and rendezvous (pytorch/pytorch#126510, pytorch/pytorch#53395)")
    print0("   (before any wrapper exists: torch.distributed's rendezvous, which both wrappers' launches go through)")
    timeout = datetime.timedelta(seconds=timeout_s)
    ports = everyone(str(find_free_port()))  # one free port per rank, each chosen by its own rank

    def store(port, world_size, master):
        # (c_stderr: the C++ side also logs each failed try, with a stack, on stderr; the error says it all)
        return lambda: c_stderr(lambda: dist.TCPStore("127.0.0.1", int(port), world_size, is_master=master,
                                                      timeout=timeout))

    taken = show("a. a port in use (this job's own MASTER_PORT, as a second job would)",
                 store(os.environ["MASTER_PORT"], 2, master=True))
    own = show("b. each rank its own MASTER_PORT (rank 0 hosts the store)",
               store(ports[rank], dist.get_world_size(), master=rank == 0))
    dist.barrier()
    short = show(f"c. a world size of {dist.get_world_size() + 1} that never fills",
                 store(ports[0], dist.get_world_size() + 1, master=rank == 0))
    assert all("EADDRINUSE" in s for s in taken), taken
    assert "waiting for clients" in own[0] and all("timed out" in s.lower() for s in own[1:]), own
    assert f"{dist.get_world_size()}/{dist.get_world_size() + 1} clients joined" in short[0], short
    why("every rank must reach the same store (MASTER_ADDR:MASTER_PORT) and the store waits until world_size "
        "ranks have joined; a port another program holds cannot host it.")
    dist.barrier()
    ok = show("fixed: one free port, chosen once by the launcher and given to every rank (torchrun, or "
              "minddp.launch.spawn's find_free_port)", store(ports[0], dist.get_world_size(), master=rank == 0))
    assert all(s == "no error" for s in ok), ok


class Checkpointed(nn.Module):
    """A block under an activation checkpoint between two plain layers."""

    reentrant = True

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.block, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(checkpoint(self.block, torch.relu(self.embed(x)), use_reentrant=self.reentrant))


def reentrant_checkpoint(rank: int, timeout_s: float) -> None:
    header(5, "a reentrant activation checkpoint with find_unused_parameters=True (huggingface/accelerate#3536)")
    x = batches(1)[0]
    said = {}
    for label, wrapper in WRAPPERS.items():
        model = wrapper(Checkpointed(), find_unused_parameters=True)
        said[label] = show(label, lambda: model(x).sum().backward())
    assert all("Expected to mark a variable ready only once" in s for s in said["torch's DDP"]), said
    assert all("block." in s and "use_reentrant=False" in s for s in said["MiniDDP"]), said
    why("a reentrant checkpoint hides the block from the autograd graph until its backward recomputes it: the "
        "search for unused parameters does not find the block, counts it unused (ready, zero), and then its "
        "gradients arrive after all.")
    grads = {}
    for fix, reentrant, kwargs in [("use_reentrant=False", False, {"find_unused_parameters": True}),
                                   ("static_graph=True", True, {"static_graph": True})]:
        Checkpointed.reentrant = reentrant
        for label, wrapper in WRAPPERS.items():
            model = wrapper(Checkpointed(), **kwargs)
            for _ in range(2):
                model.zero_grad()
                with warnings.catch_warnings():  # (both warn: the walk finds every parameter now)
                    warnings.simplefilter("ignore")
                    c_stderr(lambda: model(x).sum().backward())
            grads[fix, label] = model.module.block.weight.grad
    Checkpointed.reentrant = True
    first = next(iter(grads.values()))
    agree = all(torch.allclose(g, first, rtol=1e-5, atol=1e-6) for g in grads.values())
    fixed(f"checkpoint(..., use_reentrant=False), or static_graph=True (reentrant kept): two steps each, both "
          f"wrappers, no error; the block's gradients agree across the four runs: {agree}")
    assert agree


def slow(rank: int, timeout_s: float) -> None:
    header(6, "DDP slower than one process (pytorch/pytorch#73600): counted, not timed")
    x = batches(1)[0]
    link = PRESETS["laptop"]
    counts = {}
    for setting, kwargs in [("default", {}), ("bucket_cap_mb=1e-6", {"bucket_cap_mb": 1e-6}),
                            ("find_unused_parameters=True", {"find_unused_parameters": True})]:
        for label, wrapper in WRAPPERS.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the twin of failure 1: the flag found nothing unused)
                model = wrapper(Net(), **kwargs)
                for _ in range(2):  # the first backward shows the order, the second forward rebuilds the buckets
                    c_stderr(lambda: model(x).sum().backward())
                with CountCollectives() as count:
                    model(x).sum().backward()
            counts[setting, label] = len(count.calls)
        theirs, ours = counts[setting, "torch's DDP"], counts[setting, "MiniDDP"]
        print0(f"   {setting:<28} collectives per step: torch's DDP {theirs}, MiniDDP {ours}; on the "
               f"'{link.name}' link model at least {ours * link.alpha_s * 1e3:.0f} ms of latency per step")
    flops = 2 * 4 * (8 * 8 + 8 * 2 * 2) * 3  # 2 per multiply-add, batch 4, three layers; backward twice forward
    for label in WRAPPERS:
        assert counts["bucket_cap_mb=1e-6", label] > counts["default", label], counts
        assert counts["find_unused_parameters=True", label] > counts["default", label], counts
    assert all(counts[setting, "torch's DDP"] == counts[setting, "MiniDDP"] for setting, _ in counts), counts
    why(f"this model's step is about {flops} floating-point operations, microseconds; each collective costs at "
        "least the "
        "link's latency whatever its size. Tiny buckets multiply the collectives, and find_unused_parameters adds "
        "one (which parameters were used) plus a walk of the autograd graph every step.")
    fixed("data parallelism pays when a step's compute outweighs one all-reduce of the gradients: a bigger model or "
          "batch per rank, the default buckets (25 MiB), find_unused_parameters only when a forward skips layers, "
          "no_sync() for accumulation (lessons 07, 11, 17).")


def checkpoints(rank: int, timeout_s: float) -> None:
    header(7, "checkpoints across ranks (pytorch/examples#969)")
    folder = everyone(tempfile.mkdtemp() if rank == 0 else "")[0]  # one folder for every rank
    path = os.path.join(folder, "model.pt")
    said = {}
    for label, wrapper in WRAPPERS.items():
        saved = wrapper(Net()).state_dict()  # keys 'module.body.weight', ...
        said[label] = show(f"{label}: its state_dict() loaded into the unwrapped model",
                           lambda: Net().load_state_dict(saved))
    assert all("Error(s) in loading state_dict for Net" in s for ours in said.values() for s in ours), said
    print0('     (the lines after it: Missing key(s) "body.weight", ...; '
           'Unexpected key(s) "module.body.weight", ...)')
    torch.save({"saved_by": rank}, path)  # every rank writes the same file
    dist.barrier()
    print0(f"   every rank saved to the same file: it holds rank {torch.load(path)['saved_by']}'s, whichever "
           "wrote last (with different states on the ranks, a race; on a shared disk, a torn file)")
    why("a wrapper keeps the model as .module, so its state_dict's keys start with 'module.'. torch.save on every "
        "rank writes the file once per rank. And torch.load without map_location puts each tensor back on the "
        "device it was saved from: every rank's copy lands on GPU 0 (not reproduced here: CPU only).")
    model = MiniDDP(Net())
    if rank == 0:
        torch.save(model.module.state_dict(), path)  # the unwrapped model's keys, written once
    dist.barrier()
    from_file = outcome(lambda: Net().load_state_dict(torch.load(path, map_location="cpu")))
    old = model.state_dict()  # a file saved with the prefix
    consume_prefix_in_state_dict_if_present(old, "module.")
    from_old = outcome(lambda: Net().load_state_dict(old))
    fixed(f"save model.module.state_dict() on rank 0 only, then a barrier, and load with map_location='cpu' (or "
          f"the rank's device): {from_file}; a file saved with the prefix: "
          f"consume_prefix_in_state_dict_if_present(state, 'module.'): {from_old}")
    assert from_file == from_old == "no error", (from_file, from_old)
    dist.barrier()
    if rank == 0:
        os.remove(path)
        os.rmdir(folder)


def sampler(rank: int, timeout_s: float) -> None:
    header(8, "the sampler (pytorch/pytorch#31771)")
    data = list(range(10))
    orders = {}
    for label, make in [("torch's DistributedSampler", TorchSampler),
                        ("minddp.sampler", minddp.sampler.DistributedSampler)]:
        s = make(data, shuffle=True, seed=0)
        forgot = [list(s) for _ in range(2)]  # two epochs, set_epoch never called
        epochs = []
        for epoch in range(2):
            s.set_epoch(epoch)
            epochs.append(list(s))
        orders[label] = (forgot, epochs)
        print0(f"   {label} on rank 0: without set_epoch {forgot[0]} then {forgot[1]}; "
               f"with it {epochs[0]} then {epochs[1]}")
    (torch_forgot, torch_epochs), (ours_forgot, ours_epochs) = orders.values()
    assert torch_forgot[0] == torch_forgot[1] and torch_epochs[0] != torch_epochs[1], orders
    assert (ours_forgot, ours_epochs) == (torch_forgot, torch_epochs), orders
    # Padding: 5 samples over 2 ranks, the first repeated; "correct" marks, per sample, a right answer.
    correct = [1, 0, 0, 1, 1]  # 3 of 5 right: 60%
    size = dist.get_world_size()
    padded = TorchSampler(correct, num_replicas=size, rank=rank, shuffle=False)
    exact = minddp.sampler.DistributedSampler(correct, num_replicas=size, rank=rank, shuffle=False, pad=False)

    def accuracy(indices):
        sums = torch.tensor([sum(correct[i] for i in indices), len(indices)], dtype=torch.float64)
        dist.all_reduce(sums)
        return sums[0].item() / sums[1].item(), int(sums[1].item())

    (skewed, seen), (right, counted) = accuracy(list(padded)), accuracy(list(exact))
    print0(f"   an evaluation of {len(correct)} samples ({sum(correct)} right) on {size} ranks: padded sampler "
           f"{seen} samples, accuracy {skewed:.3f}; minddp's pad=False: {counted} samples, accuracy {right:.3f}")
    assert seen > len(correct) and skewed != right and right == sum(correct) / len(correct)
    why("the order is drawn from seed + epoch, and the epoch only changes through set_epoch. Padding repeats the "
        "first samples so every rank takes the same number of steps, which evaluation then counts twice.")
    fixed("call sampler.set_epoch(epoch) at the start of every epoch; evaluate with minddp's pad=False (or count "
          "the padded samples out) and all-reduce sums and counts, not per-rank means.")


def uneven_inputs(rank: int, timeout_s: float) -> None:
    header(9, "uneven inputs: rank 0 has one batch more (pytorch/pytorch#33148)")
    mine = batches(3 if rank == 0 else 2)
    said = {}
    for label, wrapper in WRAPPERS.items():
        model = wrapper(Net(), process_group=short_group(timeout_s))

        def epoch():
            for x in mine:
                model(x).sum().backward()

        said[label] = show(label, epoch)
    for ours in said.values():
        assert "timed out" in ours[0].lower() and all(s == "no error" for s in ours[1:]), ours
    assert "bucket" in said["MiniDDP"][0] and "join()" in said["MiniDDP"][0], said
    why("rank 0's third backward all-reduces buckets that the other ranks, out of data, never send; they have finished "
        "(and in a real job waits elsewhere, at the next epoch's first collective).")
    agree = []
    for wrapper in WRAPPERS.values():
        model = wrapper(Net())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for x in mine:
                optimizer.zero_grad()
                model(x).sum().backward()
                optimizer.step()
        agree.append(same_everywhere(model.module.parameters()))
    fixed(f"with model.join(): a rank out of data answers the others' all-reduces with zeros, and at the end the "
          f"last rank to finish hands its weights to the others; every rank finished, weights equal across ranks: "
          f"torch's DDP {agree[0]}, MiniDDP {agree[1]}")
    assert all(agree), agree


def sync_batchnorm(rank: int, timeout_s: float) -> None:
    header(10, "SyncBatchNorm (pytorch/pytorch#48988)")
    x = torch.randn(4, 3)
    torch_said = show("torch's nn.SyncBatchNorm on CPU", lambda: nn.SyncBatchNorm(3)(x))
    assert all("GPU" in s for s in torch_said), torch_said
    group = short_group(timeout_s)
    norm = SyncBatchNorm(3, process_group=group)

    def evaluate_on_rank_0():
        if rank == 0:
            norm(x)  # still in training mode: it gathers every rank's statistics

    ours = show("minddp's SyncBatchNorm, an evaluation on rank 0 only, in training mode", evaluate_on_rank_0)
    assert "timed out" in ours[0].lower() and all(s == "no error" for s in ours[1:]), ours
    why("in training mode SyncBatchNorm all-gathers every rank's batch statistics at each forward: a forward on "
        "one rank waits for the others. In eval mode it uses its running statistics and no collective.")
    norm = SyncBatchNorm(3, process_group=short_group(timeout_s)).eval()
    fine = everyone(outcome(lambda: norm(x) if rank == 0 else None))
    fixed(f"model.eval() before evaluating on one rank (or evaluate on every rank): {fine[0]}; minddp's "
          "SyncBatchNorm runs on CPU, so the whole course runs it on a laptop (lesson 10).")
    assert fine == ["no error"] * dist.get_world_size(), fine


FAILURES = {
    "unused-parameter": unused_parameter,
    "mismatched-collectives": mismatched_collectives,
    "accumulation": accumulation,
    "rendezvous": rendezvous,
    "reentrant-checkpoint": reentrant_checkpoint,
    "slow": slow,
    "checkpoints": checkpoints,
    "sampler": sampler,
    "uneven-inputs": uneven_inputs,
    "sync-batchnorm": sync_batchnorm,
}


def main(rank: int, world_size: int, names: list[str], timeout_s: float) -> None:
    print0(f"{world_size} ranks; the broken runs use process groups with a {timeout_s:g} s timeout")
    for name in names:
        FAILURES[name](rank, timeout_s)
    print0(f"\nchecked: {len(names)} failure(s), each with torch's DDP and with MiniDDP, each fixed.")


if __name__ == "__main__":
    def options(parser):
        parser.add_argument("--failure", choices=[*FAILURES, "all"], default="all", help="which failure (default: all)")
        parser.add_argument("--timeout-s", type=float, default=2.0, help="timeout of the broken runs' process groups")
    args = parse_args(__doc__, min_world_size=2, extra=options)
    run(main, args.world_size, list(FAILURES) if args.failure == "all" else [args.failure], args.timeout_s)
