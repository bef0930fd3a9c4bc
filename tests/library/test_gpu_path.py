"""The GPU path's defects that a CPU can show; tests/library/test_cuda.py has the rest.

Each test here failed on the code before the fix it names.
"""

import time
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP

PER_RANK = 4


# ------------------------------------------------ 1. bucket views and memory layout
class ChannelsLastCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 6 * 6, 4)

    def forward(self, x):
        return self.head(F.relu(self.conv(x)).flatten(1))


def _channels_last_model(seed):
    torch.manual_seed(seed)
    return ChannelsLastCNN().to(memory_format=torch.channels_last)


def _batch(step, size):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(size, 3, 6, 6, generator=g), torch.randn(size, 4, generator=g)


def _channels_last_adamw(rank, world_size, as_view):
    models = {"reference": _channels_last_model(0),
              "minddp": MiniDDP(_channels_last_model(rank), gradient_as_bucket_view=as_view, bucket_cap_mb=1e-4),
              "torch": TorchDDP(_channels_last_model(rank), gradient_as_bucket_view=as_view, bucket_cap_mb=1e-4)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for k, m in models.items()}
    weight = models["minddp"].module.conv.weight
    assert weight.is_contiguous(memory_format=torch.channels_last)
    for step in range(3):
        x, y = _batch(step, PER_RANK * world_size)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        for name, model in models.items():
            opts[name].zero_grad(set_to_none=False)
            xb, yb = (x, y) if name == "reference" else (x[mine], y[mine])
            F.mse_loss(model(xb), yb).backward()
        assert weight.grad.stride() == weight.stride(), f"step {step}: .grad strides {weight.grad.stride()}"
        for opt in opts.values():
            opt.step()
        ref = dict(models["reference"].named_parameters())
        nat = dict(models["torch"].module.named_parameters())
        for name, p in models["minddp"].module.named_parameters():
            torch.testing.assert_close(p, ref[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} {name} vs one process: {m}")
            torch.testing.assert_close(p, nat[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} {name} vs torch DDP: {m}")


@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "bucket_view"])
def test_channels_last_grad_keeps_the_parameters_strides_and_fused_adamw_matches(ranks, as_view):
    ranks(2).run(_channels_last_adamw, as_view)


def test_bucket_slots_are_laid_out_like_their_parameters():
    from minddp.ddp.core.buckets import Bucket

    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    odd = nn.Parameter(torch.randn(6, 4)[::2])  # not dense: a contiguous slot instead
    bucket = Bucket(0, [conv.weight, conv.bias, odd], ["w", "b", "odd"], [0, 1, 2])
    assert bucket.views[0].stride() == conv.weight.stride()
    assert bucket.views[2].is_contiguous()
    # the slots tile the buffer without overlap
    for i, slot in enumerate(bucket.views):
        slot.fill_(i + 1)
    assert torch.equal(bucket.buffer, torch.tensor([1.0] * 108 + [2.0] * 4 + [3.0] * 12))


# ------------------------------------------------ 2. one device per module
class TwoDevices(nn.Module):
    def __init__(self):
        super().__init__()
        self.here = nn.Linear(2, 2)
        self.elsewhere = nn.Linear(2, 2, device="meta")


def _two_device_module(rank, world_size):
    with pytest.raises(ValueError, match=r"must be on one device, but its parameters locate in \['cpu', 'meta'\]"):
        MiniDDP(TwoDevices())


def test_a_module_on_two_devices_is_refused_naming_them(ranks):
    ranks(2).run(_two_device_module)


# ------------------------------------------------ 4. device_ids as torch takes them; inputs moved
class _OnDevice:
    def __init__(self, device):
        self.device = torch.device(device)


@pytest.mark.parametrize("ids", [[torch.device("cuda")], [1], ["cuda:1"], [torch.device("cuda", 1)]], ids=str)
def test_device_ids_spelled_as_torch_accepts_them(monkeypatch, ids):
    from minddp.ddp.placement import module_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert module_device([_OnDevice("cuda:1")] * 2, ids) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"device_ids=\[0\] but the module's parameters are on \['cuda:1'\]"):
        module_device([_OnDevice("cuda:1")], [0])


def test_inputs_are_moved_to_the_device_nested_as_they_come():
    from minddp.ddp.placement import move_to_device

    x, y = torch.ones(2), torch.zeros(3)
    (args, kwargs) = move_to_device(((x, [y, 3]), {"mask": y, "name": "a"}), torch.device("meta"))
    assert args[0].device.type == args[1][0].device.type == kwargs["mask"].device.type == "meta"
    assert args[1][1] == 3 and kwargs["name"] == "a"


def _forward_moves_inputs(rank, world_size):
    # device_ids name a GPU, and a CPU module refuses them (as torch's DDP does): the device they set
    # for the inputs is set by hand here, so that the forward's move runs on this CPU-only machine.
    model = MiniDDP(nn.Linear(2, 2))
    model._input_device = torch.device("cpu")
    calls = []
    import minddp.ddp.wrapper

    original = minddp.ddp.wrapper.move_to_device
    minddp.ddp.wrapper.move_to_device = lambda inputs, device: calls.append(device) or original(inputs, device)
    try:
        model(torch.ones(1, 2)).sum().backward()
    finally:
        minddp.ddp.wrapper.move_to_device = original
    return calls


def test_forward_moves_inputs_to_device_ids0(ranks):
    assert ranks(2).run(_forward_moves_inputs) == [[torch.device("cpu")]] * 2


# ------------------------------------------------ 5. no host syncs in the steady state
class HostReads:
    """Counts what would make the CPU wait for a GPU: reading a tensor's values
    into Python (``item``, ``tolist``, ``bool``/``int``/``float`` of a tensor,
    ``torch.equal``) and building a device tensor from Python numbers
    (``torch.tensor``). On CPU none of them waits; the count is what matters."""

    READS = ("item", "tolist", "__bool__", "__int__", "__float__")

    def __enter__(self):
        self.count, self.saved = 0, {}

        def counted(owner, name):
            original = getattr(owner, name)
            self.saved[(owner, name)] = original

            def wrapper(*args, **kwargs):
                self.count += 1
                return original(*args, **kwargs)

            setattr(owner, name, wrapper)

        for name in self.READS:
            counted(torch.Tensor, name)
        counted(torch, "tensor")
        counted(torch, "equal")
        return self

    def __exit__(self, *exc):
        for (owner, name), original in self.saved.items():
            setattr(owner, name, original)


def _join_step_reads(rank, world_size):
    model = MiniDDP(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = []
    with model.join():
        for step in range(3 + rank):  # uneven: rank 1 has one batch more
            with HostReads() as reads:
                model(torch.ones(2, 4)).sum().backward()
            opt.step()
            counts.append(reads.count)
    return counts[1:3]  # steady-state steps that every rank trains in


def test_join_reads_nothing_back_per_training_step(ranks):
    assert ranks(2).run(_join_step_reads) == [[0, 0], [0, 0]]


def _sync_bn_reads(rank, world_size):
    from minddp.sync_batchnorm import SyncBatchNorm

    bn = SyncBatchNorm(3)
    x = torch.randn(4, 3, 2, 2, requires_grad=True)
    bn(x).sum().backward()
    with HostReads() as reads:
        bn(x).sum().backward()
    return reads.count


def test_sync_batchnorm_waits_once_per_forward_like_torchs(ranks):
    assert ranks(2).run(_sync_bn_reads) == [1, 1]


def _desync_check_reads(rank, world_size):
    from minddp.ddp.replicas import check_replicas_in_sync

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(5)])  # 10 tensors
    with HostReads() as reads:
        check_replicas_in_sync(model)
    return reads.count


def test_desync_check_waits_once_not_once_per_tensor(ranks):
    assert ranks(2).run(_desync_check_reads) == [1, 1]


# ------------------------------------------------ 7. one GPU: both wrappers communicate
import os  # noqa: E402
import sys  # noqa: E402

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def _all_reduces_per_step(rank, world_size, names):
    sys.path.insert(0, BENCHMARKS)
    import torch.distributed as dist

    import compare
    from benchlib.timing import Runner

    args = compare.parse_args(["--world-size", "1", "--models", "mlp"])
    notes = compare.check_environment(args)
    runner = Runner(compare.config(args), "mlp", 25.0, rank, world_size, torch.device("cpu"))
    counts, original = {}, dist.all_reduce
    for name in names:
        step = runner.stepper(runner.wrapped(name))
        step()  # torch's DDP rebuilds its buckets after the first step
        calls = []
        dist.all_reduce = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            step()
        finally:
            dist.all_reduce = original
        counts[name] = len(calls)
    return args.comm_hook, notes, counts


def test_at_world_size_one_the_benchmark_makes_both_wrappers_communicate(ranks):
    # torch's DDP always all-reduces (in C++, out of this count's sight); with
    # the same all-reduce hook MiniDDP does too, where it skipped it before.
    hook, notes, counts = ranks(1).run(_all_reduces_per_step, ["minddp_copy", "minddp_view"])[0]
    assert hook == "allreduce" and any("both wrappers get an all-reduce comm hook" in n for n in notes)
    assert min(counts.values()) >= 1, counts  # one per bucket (none before)


# ------------------------------------------------ 8. launch edge cases
def _environment_of_a_spawned_rank(rank, world_size, folder):
    import json

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID")
    with open(os.path.join(folder, f"{rank}.json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)


def test_spawned_ranks_do_not_inherit_the_launchers_variables(tmp_path, monkeypatch):
    import json

    from minddp.launch import spawn

    # As if this process had been started by torchrun (and inside a SLURM job).
    for name, value in {"RANK": "3", "LOCAL_RANK": "5", "WORLD_SIZE": "8", "TORCHELASTIC_RESTART_COUNT": "0",
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "SLURM_PROCID": "3"}.items():
        monkeypatch.setenv(name, value)
    spawn(_environment_of_a_spawned_rank, 2, str(tmp_path), backend="gloo")
    for rank in range(2):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                        "TORCHELASTIC_RESTART_COUNT": None, "SLURM_PROCID": None}


@pytest.mark.parametrize("gpus,world_size,env,expected", [
    (0, 1, {}, "gloo"),
    (1, 1, {}, "nccl"),
    (1, 2, {}, "gloo"),  # two ranks, one GPU: NCCL would refuse
    (2, 2, {}, "nccl"),
    (2, 8, {"LOCAL_WORLD_SIZE": "2"}, "nccl"),  # 4 machines of 2 ranks, 2 GPUs each
    (2, 8, {"SLURM_NTASKS_PER_NODE": "4(x2)"}, "gloo"),
])
def test_default_backend_is_nccl_only_with_a_gpu_per_rank_of_this_machine(monkeypatch, gpus, world_size, env, expected):
    from minddp.launch import default_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert default_backend(world_size, env) == expected


def test_gloo_sets_each_ranks_cuda_device(monkeypatch):
    import torch.distributed as dist

    from minddp import launch

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: None)
    launch.init_distributed("gloo", rank=3, world_size=4, env={"LOCAL_RANK": "3"})
    assert chosen == [1]  # local rank 3 on 2 GPUs


@pytest.mark.parametrize("message,echo", [
    ("NCCL error in: ProcessGroupNCCL.cpp:1, unhandled cuda error, NCCL version 2.21\n"
     "ncclUnhandledCudaError: Call to CUDA function failed.", False),
    ("NCCL error in: ProcessGroupNCCL.cpp:1, invalid usage, NCCL version 2.21\nncclInvalidUsage: ...", False),
    ("CUDA error: an illegal memory access was encountered", False),
    ("NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited or there was a network error\n"
     "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.", True),
    ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)", True),
    ("Connection closed by peer [127.0.0.1]:1234", True),
])
def test_a_ranks_own_nccl_error_is_not_an_echo(message, echo):
    import torch.distributed as dist

    from minddp_lab.train.errors import is_communication_error

    assert is_communication_error(dist.DistBackendError(message)) is echo
    assert is_communication_error(RuntimeError(message)) is echo


# ------------------------------------------------ 9. pinned batches for GPUs
def test_loaders_pin_memory_when_the_ranks_train_on_gpus(monkeypatch):
    import torch.distributed as dist

    from minddp_lab.data import SyntheticMNIST, make_loader

    data = SyntheticMNIST(size=8)
    assert make_loader(data, 4, rank=0, world_size=1).pin_memory is False
    assert make_loader(data, 4, rank=0, world_size=1, pin_memory=True).pin_memory is True
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert make_loader(data, 4, rank=0, world_size=1).pin_memory is True


# ------------------------------------------------ 6. trace times from the device's clock
class _TickClock:
    """Stands in for DeviceClock: each stamp one second after the last."""

    def __init__(self):
        self.t = 0.0

    def now(self):
        self.t += 1.0
        return self.t

    def seconds(self, stamp):
        return stamp


def test_tracer_stamps_launch_and_completion_with_its_clock():
    from minddp.ddp.observers.trace import COMM_TRACK, StepObserver

    observer = StepObserver(0, trace=True)
    observer.tracer.clock = _TickClock()
    bucket = types.SimpleNamespace(index=0, buffer=torch.zeros(1), future=torch.futures.Future())
    observer.backward_started()  # stamp 1
    before = time.perf_counter()
    observer.bucket_launching(bucket)  # the CPU time, for the timeline
    observer.bucket_launched(bucket)  # stamp 2: not the CPU time
    bucket.future.set_result(None)  # stamp 3, taken in the completion callback
    (bar,) = [e for e in observer.tracer.events if e["tid"] == COMM_TRACK]
    assert (bar["ts"], bar["dur"]) == (2e6, 1e6)
    assert before <= observer.timeline.launches[0] <= time.perf_counter()  # the timeline keeps CPU times


# ------------------------------------------------ the GPU tests' own imports, checked on a CPU
def test_every_minddp_name_the_gpu_tests_import_exists():
    # tests/library/test_cuda.py imports inside its rank functions, which run only on a GPU: a module renamed
    # since (minddp.comm_hooks -> minddp.ddp.default_hooks) failed 15 of them on the first GPU lent.
    import ast
    import importlib.util
    from pathlib import Path

    source = Path(__file__).with_name("test_cuda.py").read_text()
    imports = [node for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "minddp"]
    assert imports, "test_cuda.py imports nothing of minddp: nothing was checked"
    for node in imports:
        module = importlib.import_module(node.module)
        for alias in node.names:
            found = hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}")
            assert found, f"test_cuda.py line {node.lineno}: from {node.module} import {alias.name}: no such name"
