"""What every rank runs: the measurements behind one row of the table.

One row is one (model, bucket cap). Every rank builds, from the same seed and
the same initial state, five things it can step:

==============  ==============================================================
``local``       the bare model: forward, backward, SGD step; no communication
``allreduce``   no model: ``dist.all_reduce`` of the gradient bytes alone, in
                flat buffers laid out like DDP's buckets (reverse parameter
                order, first bucket capped at 1 MiB, then the chosen cap),
                all launched asynchronously, then waited for. With a
                compression hook the buffers are in the wire dtype (fp16/bf16)
``naive``       the bare model, then a blocking ``all_reduce`` of every
                ``.grad`` after backward (no buckets, no overlap), SGD step
``torch_ddp``   ``torch.nn.parallel.DistributedDataParallel``, same cap
``minddp``      ``minddp.MiniDDP``, same cap
==============  ==============================================================

Timing: every implementation first runs ``warmup`` steps (torch's DDP builds
its real buckets after its first iteration; that is never timed). Then
``repeats`` rounds: each round times a block of ``k`` consecutive steps of
each implementation in turn, ranks starting together after a barrier; the
two DDPs alternate which goes first (A/B, B/A, ...) so that slow drift of the
machine hits both alike. A block's time per step is the *slowest rank's*
(a step is over when every rank is), and each figure is the median over the
rounds. In a bucket sweep, ``local`` and ``naive`` do not depend on the cap:
they are measured at a model's first cap only and reused for the others.

Correctness: ``torch_ddp`` and ``minddp`` start from the same weights, take
the same batches in the same order and the same number of steps (plain SGD,
no momentum, so nothing hides a difference); afterwards the largest absolute
difference between their parameters, over all ranks, is reported.

Peak memory is measured in separate processes after timing (``memory_main``;
why, in ``_memory.py``). The ``--learned-order`` measurement and the
``--trace`` steps run after the table's timings, in ``_overlap.py``.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from minddp.buckets import MiB, TensorSpec, assign_buckets
from minddp.ddp import FIRST_BUCKET_CAP_MB

import _memory
import _overlap


# Per-rank batch size: the MLP is meant to be communication-bound (many
# parameters, little compute per step), the CNN compute-heavier, the
# autoencoder as in the seed tutorial.
BATCH_SIZE = {"mlp": 32, "cnn": 32, "ae": 128, "resnet": 32, _overlap.SHUFFLED: 32}
N_BATCHES = 4  # fixed random batches per rank, cycled
LR = 0.01


# -- the package under test, through its public API --------------------------
def _minddp_api():
    from minddp import MiniDDP
    from minddp.models import build_model, model_loss

    # The benchmark's own model (a classifier, so cross-entropy like "mlp").
    def build(name: str) -> torch.nn.Module:
        return _overlap.ShuffledMLP() if name == _overlap.SHUFFLED else build_model(name)

    def loss(name: str, *args) -> torch.Tensor:
        return model_loss("mlp" if name == _overlap.SHUFFLED else name, *args)

    return MiniDDP, build, loss


def _hooks(name: str):
    """(torch's hook, MiniDDP's hook) for ``--comm-hook``; (None, None) for none."""
    if name == "none":
        return None, None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

    from minddp import comm_hooks as mh

    return {
        "fp16": (dh.fp16_compress_hook, mh.fp16_compress_hook),
        "bf16": (dh.bf16_compress_hook, mh.bf16_compress_hook),
    }[name]


def wire_dtype(hook: str, dtype: torch.dtype) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(hook, dtype)


def bucket_sizes(params: list[torch.Tensor], cap_mb: float) -> list[int]:
    """Element counts of the buckets MiniDDP would build first (reverse order, 1 MiB first, then cap)."""
    ordered = list(reversed(params))
    groups = assign_buckets([TensorSpec.of(p) for p in ordered], int(cap_mb * MiB), int(FIRST_BUCKET_CAP_MB * MiB))
    return [sum(ordered[i].numel() for i in group) for group in groups]


class Runner:
    """Everything one rank needs for one (model, bucket cap)."""

    def __init__(self, cfg: dict, model_name: str, cap_mb: float, rank: int, world_size: int, device: torch.device):
        MiniDDP, build_model, model_loss = _minddp_api()
        self.cfg, self.name, self.cap_mb = cfg, model_name, cap_mb
        self.rank, self.world_size, self.device = rank, world_size, device
        self.MiniDDP, self.model_loss = MiniDDP, model_loss
        torch.manual_seed(0)  # same initial weights on every rank, for every copy
        template = build_model(model_name)
        self.init_state = copy.deepcopy(template.state_dict())
        self.build_model = build_model
        g = torch.Generator().manual_seed(1000 + rank)  # different data per rank
        bs = BATCH_SIZE.get(model_name, 32)
        self.batches = [
            (torch.rand(bs, 1, 28, 28, generator=g).to(device), torch.randint(0, 10, (bs,), generator=g).to(device))
            for _ in range(N_BATCHES)
        ]
        self.torch_hook, self.minddp_hook = _hooks(cfg["comm_hook"])
        # NCCL only reduces CUDA tensors; Gloo reduces both.
        self.comm_device = device if cfg["backend"] == "nccl" else torch.device("cpu")

    # -- builders ------------------------------------------------------------
    def fresh(self) -> torch.nn.Module:
        model = self.build_model(self.name)
        model.load_state_dict(self.init_state)
        return model.to(self.device)

    def wrap_torch(self, model: torch.nn.Module) -> torch.nn.Module:
        kw = {}
        if self.device.type == "cuda":
            kw["device_ids"] = [self.device]
        ddp = DistributedDataParallel(
            model, bucket_cap_mb=self.cap_mb, gradient_as_bucket_view=self.cfg["torch_bucket_view"], **kw
        )
        if self.torch_hook is not None:
            ddp.register_comm_hook(None, self.torch_hook)
        return ddp

    def wrap_minddp(self, model: torch.nn.Module, **extra) -> torch.nn.Module:
        """``extra``: further MiniDDP arguments (``trace``, ``learn_bucket_order``)."""
        ddp = self.MiniDDP(
            model, bucket_cap_mb=self.cap_mb, gradient_as_bucket_view=self.cfg["minddp_bucket_view"], **extra
        )
        if self.minddp_hook is not None:
            ddp.register_comm_hook(None, self.minddp_hook)
        return ddp

    def stepper(self, module: torch.nn.Module, after_backward: Callable[[], None] | None = None):
        """A closure running one training step of ``module`` on the next batch."""
        opt = torch.optim.SGD(module.parameters(), lr=LR)
        count = [0]

        def step() -> None:
            x, y = self.batches[count[0] % N_BATCHES]
            count[0] += 1
            opt.zero_grad()
            self.model_loss(self.name, module(x), x, y).backward()
            if after_backward is not None:
                after_backward()
            opt.step()

        step.module = module
        step.count = count
        return step

    def naive_sync(self, model: torch.nn.Module) -> Callable[[], None]:
        params = [p for p in model.parameters() if p.requires_grad]

        def sync() -> None:
            for p in params:
                if p.grad is None:
                    continue
                p.grad.div_(self.world_size)
                dist.all_reduce(p.grad)

        return sync

    def allreduce_step(self) -> Callable[[], None]:
        model = self.fresh()
        params = [p for p in model.parameters() if p.requires_grad]
        dtype = wire_dtype(self.cfg["comm_hook"], params[0].dtype)
        buffers = [torch.zeros(n, dtype=dtype, device=self.device) for n in bucket_sizes(params, self.cap_mb)]
        del model

        def step() -> None:
            works = [dist.all_reduce(b, async_op=True) for b in buffers]
            for w in works:
                w.wait()

        step.count = [0]
        return step

    # -- measurements --------------------------------------------------------
    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time_block(self, step: Callable[[], None], k: int) -> float:
        dist.barrier()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(k):
            step()
        self.sync()
        return (time.perf_counter() - t0) / k * 1000.0

    def medians(self, steps: dict[str, Callable[[], None]], pair: tuple[str, str]) -> dict[str, float]:
        """Warm every step up, then time rounds of one block each; the two of
        ``pair`` go last, alternating which goes first. Returns, per name, the
        median over rounds of each block's slowest-rank ms per step."""
        cfg = self.cfg
        for step in steps.values():
            for _ in range(cfg["warmup"]):
                step()
        k = max(1, cfg["steps"] // cfg["repeats"])
        times: dict[str, list[float]] = {name: [] for name in steps}
        for r in range(cfg["repeats"]):
            order = list(pair) if r % 2 == 0 else list(reversed(pair))
            for name in [n for n in steps if n not in pair] + order:
                times[name].append(self.time_block(steps[name], k))
        names = list(times)
        t = torch.tensor([times[n] for n in names], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return {n: statistics.median(t[i].tolist()) for i, n in enumerate(names)}

    def measure(self, known: dict | None = None) -> dict:
        """Median ms/step of each implementation, and the two DDPs' parameter gap.

        ``known``: medians of ``local`` and ``naive`` already measured for this
        model at another bucket cap (they do not depend on it): not re-run.
        """
        known = known or {}
        steps = {}
        if "local" not in known:
            local_model = self.fresh()
            steps["local"] = self.stepper(local_model)
        steps["allreduce"] = self.allreduce_step()
        if "naive" not in known:
            naive_model = self.fresh()
            steps["naive"] = self.stepper(naive_model, self.naive_sync(naive_model))
        steps["torch_ddp"] = self.stepper(self.wrap_torch(self.fresh()))
        steps["minddp"] = self.stepper(self.wrap_minddp(self.fresh()))
        med = self.medians(steps, ("torch_ddp", "minddp"))
        med.update({n: v for n, v in known.items() if n in ("local", "naive")})

        a = steps["torch_ddp"].module.module.parameters()
        b = steps["minddp"].module.module.parameters()
        assert steps["torch_ddp"].count[0] == steps["minddp"].count[0]
        diff = max(((p.detach() - q.detach()).abs().max().item() for p, q in zip(a, b)), default=0.0)
        diff_t = torch.tensor([diff], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
        del steps
        _memory.release()
        return {"median_ms": med, "max_param_diff": diff_t.item()}

    def peak_memory(self, n_steps: int | None = None) -> dict:
        """Peak memory of each DDP's construction + steps, in fresh windows, max over ranks."""
        if n_steps is None:  # past torch's bucket rebuild (second step), then steady steps
            n_steps = self.cfg["warmup"] + self.cfg["memory_steps"]
        out = {}
        for name, wrap in (("torch_ddp", self.wrap_torch), ("minddp", self.wrap_minddp)):
            model = self.fresh()
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            dist.barrier()

            def run(after_step, wrap=wrap, model=model, opt=opt) -> None:
                ddp = wrap(model)
                for i in range(n_steps):
                    x, y = self.batches[i % N_BATCHES]
                    opt.zero_grad()
                    self.model_loss(self.name, ddp(x), x, y).backward()
                    opt.step()
                    after_step()
                del ddp

            out[name] = _memory.peak_delta_mb(run, self.device)
            del model, opt
            _memory.release()
        t = torch.tensor([out["torch_ddp"], out["minddp"]], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return {"torch_ddp": t[0].item(), "minddp": t[1].item()}


def _device(cfg: dict) -> torch.device:
    if cfg["device"] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _cases(cfg: dict) -> list[tuple[str, float]]:
    return [(name, cap) for name in cfg["models"] for cap in cfg["bucket_caps"]]


def timing_main(rank: int, world_size: int, cfg: dict, out_path: str) -> None:
    """Every rank of the timing run (inside an initialised process group)."""
    torch.set_num_threads(cfg["threads_per_rank"])
    device = _device(cfg)
    out, cap_free = [], {}  # cap_free: model -> its local and naive medians
    for name, cap in _cases(cfg):
        if rank == 0:
            print(f"[compare] timing {name}, bucket cap {cap:g} MB ...", file=sys.stderr, flush=True)
        result = Runner(cfg, name, cap, rank, world_size, device).measure(known=cap_free.get(name))
        cap_free.setdefault(name, {n: result["median_ms"][n] for n in ("local", "naive")})
        out.append({"model": name, "bucket_cap_mb": cap, **result})
    def make_runner(name: str, cap: float) -> Runner:
        return Runner(cfg, name, cap, rank, world_size, device)

    learned = [_overlap.learned_order_row(cfg, make_runner)] if cfg.get("learned_order_cap_mb") else []
    _overlap.record_traces(cfg, make_runner)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"rows": out, "learned_order": learned}, f)


def memory_main(rank: int, world_size: int, cfg: dict, out_path: str) -> None:
    """Every rank of the memory run: fresh processes, started with the
    allocator setting of ``_memory.ALLOCATOR_ENV`` (see ``_memory.py``)."""
    torch.set_num_threads(cfg["threads_per_rank"])
    device = _device(cfg)
    out, seen = [], set()
    if rank == 0:
        print("[compare] peak memory ...", file=sys.stderr, flush=True)
    for name, cap in _cases(cfg):
        runner = Runner(cfg, name, cap, rank, world_size, device)
        if name not in seen:  # unmeasured: first-use costs (code pages, lazy init) land here
            runner.peak_memory(n_steps=2)
            seen.add(name)
        out.append({"model": name, "bucket_cap_mb": cap, **runner.peak_memory()})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"memory": out, "method": _memory.method(device)}, f)
