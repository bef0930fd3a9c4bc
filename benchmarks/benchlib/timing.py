"""What every rank runs: the measurements behind one row of the table.

One row is one (model, bucket cap). Every rank builds, from the same seed and
the same initial state, the things it can step:

=======================  =====================================================
``local``                the bare model: forward, backward, SGD step; no
                         communication
``forward``              the bare model's forward pass and loss alone (no
                         backward): with ``local`` and ``allreduce_flat``,
                         the overlap bound (``benchlib/bound.py``)
``allreduce``            no model: ``dist.all_reduce`` of the gradient bytes
                         alone, in flat buffers laid out like DDP's buckets
                         (reverse parameter order, the first bucket capped at
                         1 MiB at the default cap, else at the cap), all launched
                         asynchronously, then waited for. With a compression
                         hook the buffers are in the wire dtype (fp16/bf16)
``allreduce_flat``       one ``all_reduce`` of all those bytes in one flat
                         buffer: with ``local``, the bound (``benchlib/bound.py``)
``naive``                the bare model, then a blocking ``all_reduce`` of
                         every ``.grad`` after backward (no buckets, no
                         overlap), SGD step
``torch_copy``           ``torch.nn.parallel.DistributedDataParallel`` with
``torch_view``           ``gradient_as_bucket_view`` False (its default) / True;
                         at the 25 MB row no cap is given (torch's default:
                         the first bucket 1 MiB); a cap given, torch makes
                         the first bucket that cap too
``minddp_copy``          ``minddp.MiniDDP``, the same two settings (False is
``minddp_view``          its default too)
``minddp_auto``          MiniDDP at its fastest: ``plan_buckets`` (it
                         measures its first steps and the link, and rebuilds
                         its buckets once; every implementation gets the same
                         warm-up, long enough for that) and
                         ``buffer_sync="with_gradients"`` (buffers ride in the
                         last bucket: one collective fewer where there are any)
``<wrapper>_nocomm``     the same four wrappers with a communication hook that
                         communicates nothing (:func:`return_bucket`): what
                         each costs beyond the bare model is its own work
                         (hooks, copies, callbacks, buffer broadcast)
=======================  =====================================================

Timing: every implementation first runs ``warmup`` steps (torch's DDP builds
its real buckets after its first iteration; that is never timed). Then
``repeats`` rounds: each round times a block of ``k`` consecutive steps of
each implementation in turn, ranks starting together after a barrier; the
order rotates by one every round, so slow drift of the machine and "who ran
just before" hit every implementation alike. A block's time per step is the
*slowest rank's* (a step is over when every rank is). Every block's time goes
back to the parent (``benchlib/spread.py`` turns them into medians, ratios and
overheads, and those over ``--runs`` into medians with min-max). In a bucket
sweep, ``naive`` does not depend on the cap: it is measured at a model's
first cap only.

Correctness: every torch/MiniDDP pair with the same setting starts from the
same weights, takes the same batches in the same order and the same number
of steps (plain SGD, no momentum, so nothing hides a difference); afterwards
the largest absolute difference between their parameters, over all ranks and
pairs, is reported.

Each row runs in rank processes of its own (``benchlib/rank_work.py``'s
``timing_main``). Peak memory is measured in separate processes after timing
(``memory_main`` there; why, in ``benchlib/memory.py``). The
``--learned-order`` measurement and the ``--trace`` steps run after the
table's timings, in processes of their own too (``extras_main``,
``benchlib/overlap.py``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from minddp import MiniDDP
from minddp_lab.auto import plan_buckets, planner_of

from benchlib import bound, memory, models
from benchlib.wrappers import (AUTO, NOCOMM, bucket_sizes, cap_argument, comm_hooks, return_bucket, wire_dtype,
                               wrapper_names)

LR = 0.01


class Runner:
    """Everything one rank needs for one (model, bucket cap)."""

    def __init__(self, cfg: dict, model_name: str, cap_mb: float, rank: int, world_size: int, device: torch.device,
                 on_round: Callable[[int], None] | None = None):  # fmt: skip
        """``on_round(r)``: called as round ``r`` (from 0) of :meth:`block_times` starts (the progress line)."""
        self.cfg, self.name, self.cap_mb = cfg, model_name, cap_mb
        self.on_round = on_round
        self.rank, self.world_size, self.device = rank, world_size, device
        torch.manual_seed(0)  # same initial weights on every rank, for every copy
        self.init_state = copy.deepcopy(models.build(model_name).state_dict())
        self.batches = models.batches(model_name, rank, device)
        self.torch_hook, self.minddp_hook = comm_hooks(cfg["comm_hook"])
        # NCCL only reduces CUDA tensors; Gloo reduces both.
        self.comm_device = device if cfg["backend"] == "nccl" else torch.device("cpu")

    # -- builders ------------------------------------------------------------
    def fresh(self) -> torch.nn.Module:
        model = models.build(self.name)
        model.load_state_dict(self.init_state)
        return model.to(self.device)

    def wrap_torch(self, model: torch.nn.Module, view: bool, nocomm: bool = False) -> torch.nn.Module:
        kw = {"device_ids": [self.device]} if self.device.type == "cuda" else {}
        ddp = DistributedDataParallel(model, bucket_cap_mb=cap_argument(self.cap_mb), gradient_as_bucket_view=view, **kw)
        hook = return_bucket if nocomm else self.torch_hook
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        return ddp

    def wrap_minddp(self, model: torch.nn.Module, view: bool = True, nocomm: bool = False, **extra) -> torch.nn.Module:
        """``extra``: further MiniDDP arguments (``trace``, ``learn_bucket_order``)."""
        ddp = MiniDDP(model, bucket_cap_mb=cap_argument(self.cap_mb), gradient_as_bucket_view=view, **extra)
        hook = return_bucket if nocomm else self.minddp_hook
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        return ddp

    def wrapped(self, name: str) -> torch.nn.Module:
        """A fresh model in the wrapper ``name`` of :func:`wrapper_names`."""
        if name == AUTO:
            ddp = MiniDDP(self.fresh(), buffer_sync="with_gradients")
            if self.minddp_hook is not None:
                ddp.register_comm_hook(None, self.minddp_hook)
            plan_buckets(ddp)
            return ddp
        impl, view = name.split("_")[:2]
        wrap = self.wrap_torch if impl == "torch" else self.wrap_minddp
        return wrap(self.fresh(), view=view == "view", nocomm=name.endswith(NOCOMM))

    def stepper(self, module: torch.nn.Module, after_backward: Callable[[], None] | None = None):
        """A closure running one training step of ``module`` on the next batch."""
        opt = torch.optim.SGD(module.parameters(), lr=LR)
        count = [0]

        def step() -> None:
            x, y = self.batches[count[0] % len(self.batches)]
            count[0] += 1
            opt.zero_grad()
            models.loss(self.name, module, x, y).backward()
            if after_backward is not None:
                after_backward()
            opt.step()

        step.module = module
        step.count = count
        return step

    def settle(self, step: Callable[[], None]) -> None:
        """Run a ``plan_buckets`` wrapper's ``step`` until its buckets are final (its planner timed its
        proposals and asked for the kept plan, which the next step builds), then start it over from the same
        weights and batches as the other wrappers, so that their parameters still compare after the same
        steps. Every rank steps alike: the planner's schedule is the same on all of them.

        The weights only: buffers written between a backward and the next forward would not reach the
        other ranks under ``buffer_sync="with_gradients"`` (rank 0's were sent with the gradients), which
        MiniDDP rightly warns about; BatchNorm's running statistics take no part in a training step."""
        module = getattr(step, "module", None)
        planner = planner_of(module) if module is not None else None
        if planner is None:
            return
        while not planner.settled:
            step()
        step()
        with torch.no_grad():  # (not load_state_dict: BatchNorm's would write num_batches_tracked)
            for name, param in step.module.module.named_parameters():
                param.copy_(self.init_state[name])
        step.count[0] = 0

    def forward_only(self) -> Callable[[], None]:
        """The bare model's forward pass and loss on the next batch, no backward (``benchlib/bound.py``)."""
        count = [0]

        def forward_loss(module: torch.nn.Module) -> torch.Tensor:
            x, y = self.batches[count[0] % len(self.batches)]
            count[0] += 1
            return models.loss(self.name, module, x, y)

        return bound.forward_step(self.fresh(), forward_loss)

    def naive_sync(self, model: torch.nn.Module) -> Callable[[], None]:
        params = [p for p in model.parameters() if p.requires_grad]

        def sync() -> None:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(self.world_size)
                    dist.all_reduce(p.grad)

        return sync

    def allreduce_step(self, flat: bool = False) -> Callable[[], None]:
        """The gradient bytes alone, in DDP-like buckets; ``flat``: in one buffer (``benchlib/bound.py``)."""
        params = [p for p in self.fresh().parameters() if p.requires_grad]
        dtype = wire_dtype(self.cfg["comm_hook"], params[0].dtype)
        if flat:
            return bound.flat_allreduce_step(params, dtype, self.device)
        buffers = [torch.zeros(n, dtype=dtype, device=self.device) for n in bucket_sizes(params, self.cap_mb)]

        def step() -> None:
            for work in [dist.all_reduce(b, async_op=True) for b in buffers]:
                work.wait()

        step.count = [0]
        return step

    # -- measurements --------------------------------------------------------
    def time_block(self, step: Callable[[], None], k: int) -> float:
        dist.barrier()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(k):
            step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - t0) / k * 1000.0

    def warm_up(self, steps: dict[str, Callable[[], None]]) -> None:
        """Settle every ``plan_buckets`` wrapper (:meth:`settle`) before any other wrapper steps, then
        run each ``warmup`` steps. ``auto`` times its proposals on real steps, so it chooses in the process as
        a user's script leaves it: with other models trained there first, mlp's trials on fast links kept one
        bucket, 3% to 5% slower than three, in 14 of 30 runs; with none, in 0 of 18 (docs/real_links.md)."""
        for step in steps.values():
            self.settle(step)
        for step in steps.values():
            for _ in range(self.cfg["warmup"]):
                step()

    def block_times(self, steps: dict[str, Callable[[], None]]) -> dict[str, list[float]]:
        """Warm every step up (:meth:`warm_up`: ``plan_buckets`` settled first), then time
        ``repeats`` rounds of one block each, the order rotating by one per round. Per name, every
        round's slowest-rank ms per step."""
        cfg = self.cfg
        self.warm_up(steps)
        k = max(1, cfg["steps"] // cfg["repeats"])
        names = list(steps)
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(cfg["repeats"]):
            if self.on_round is not None:
                self.on_round(r)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(self.time_block(steps[name], k))
        t = torch.tensor([times[n] for n in names], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return {n: t[i].tolist() for i, n in enumerate(names)}

    def medians(self, steps: dict[str, Callable[[], None]]) -> dict[str, float]:
        """:meth:`block_times`, each name's median over rounds."""
        return {n: statistics.median(v) for n, v in self.block_times(steps).items()}

    def measure(self, with_naive: bool = True) -> dict:
        """Every block time of every implementation, and each torch/MiniDDP pair's parameter gap."""
        steps = {"local": self.stepper(self.fresh()), bound.FORWARD: self.forward_only(),
                 "allreduce": self.allreduce_step(), bound.FLAT: self.allreduce_step(flat=True)}
        if with_naive:
            naive_model = self.fresh()
            steps["naive"] = self.stepper(naive_model, self.naive_sync(naive_model))
        for name in wrapper_names(self.cfg):
            steps[name] = self.stepper(self.wrapped(name))
        # plan_buckets prints its decision (rank 0) in every run of every row: kept, and
        # shown once per model by timing_main instead.
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            blocks = self.block_times(steps)
        decisions = [line for line in printed.getvalue().splitlines() if "plan_buckets" in line]
        diffs = []
        for name in (n for n in steps if n.startswith("torch_")):
            twin = steps["minddp_" + name[len("torch_") :]]
            assert steps[name].count[0] == twin.count[0]
            pairs = zip(steps[name].module.module.parameters(), twin.module.module.parameters())
            diffs.append(max(((p.detach() - q.detach()).abs().max().item() for p, q in pairs), default=0.0))
        auto_diff = 0.0
        if AUTO in steps:  # other buckets than torch's: the same sums, maybe in another order
            pairs = zip(steps["torch_copy"].module.module.parameters(), steps[AUTO].module.module.parameters())
            auto_diff = max(((p.detach() - q.detach()).abs().max().item() for p, q in pairs), default=0.0)
        diff_t = torch.tensor([max(diffs), auto_diff], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
        out = {"block_ms": blocks, "max_param_diff": diff_t[0].item()}
        if AUTO in steps:
            choice = planner_of(steps[AUTO].module).choice  # rank 0's (the one that writes the results)
            out.update(max_param_diff_auto=diff_t[1].item(), auto_buckets=len(steps[AUTO].module.bucket_names),
                       auto_decision=decisions[-1] if decisions else "")
            if choice is not None:
                out["auto_predicted_ms"] = choice.predicted_ms
        del steps
        memory.release()
        return out

    def peak_memory(self, n_steps: int | None = None, windows: int | None = None,
                    names: list[str] | None = None) -> dict[str, list[float]]:
        """Peak memory of each wrapper's construction + steps (with communication, unless ``names`` asks
        for a ``_nocomm`` one), max over ranks, in ``windows`` fresh windows each, the wrappers taking
        turns: every wrapper's readings."""
        if n_steps is None:  # past torch's bucket rebuild (second step), then steady steps
            n_steps = self.cfg["warmup"] + self.cfg["memory_steps"]
        if windows is None:
            windows = self.cfg["memory_windows"]
        if names is None:
            names = [n for n in wrapper_names(self.cfg) if not n.endswith(NOCOMM)]

        def window(name: str) -> float:
            dist.barrier()

            def run(after_step) -> None:
                step = self.stepper(self.wrapped(name))
                for _ in range(n_steps):
                    step()
                    after_step()
                del step

            peak = torch.tensor([memory.peak_delta_mb(run, self.device)], dtype=torch.float64, device=self.comm_device)
            memory.release()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            return peak.item()

        return memory.peak_windows(window, names, windows)
