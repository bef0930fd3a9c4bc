"""The CUDA/NCCL path, on one GPU: what scripts/gpu_check.sh runs first.

Two settings fit one GPU. NCCL refuses two ranks on one GPU, so NCCL runs at
world size 1 with a communicating comm hook (real NCCL all-reduces, CUDA
futures). Gloo reduces CUDA tensors too (through host copies), so 2 Gloo
ranks share the GPU and run the equivalence oracle with ``device=cuda``:
after every step MiniDDP equals one process on the whole batch and torch's
DDP. Each test names the defect it would have caught (channels_last
layout, device_ids, host syncs, device-side times); a few are guards of paths
never run on a GPU before (streams, AMP, sparse, static_graph).

Skipped, saying why, where torch sees no GPU (CI has none).
"""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp_lab.rank_pool import RankPool

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False); run bash scripts/gpu_check.sh on a GPU machine",
)
PER_RANK = 4
CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def nccl1():
    """One rank; each test function joins a world-1 NCCL group (without set_device) on first use."""
    with RankPool(1, init_group=False) as pool:
        yield pool


@pytest.fixture(scope="module")
def gloo2():
    """Two Gloo ranks sharing GPU 0."""
    with RankPool(2) as pool:
        yield pool


def _nccl():
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)  # no torch.cuda.set_device: the tutorial's form


class Net(nn.Module):
    """A channels_last convolution (fused AdamW needs its .grad laid out alike), optional BatchNorm and an unused layer."""

    def __init__(self, bn=False, unused=False, checkpointed=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8) if bn else nn.Identity()
        self.mid = nn.Linear(8 * 6 * 6, 16)
        self.head = nn.Linear(16, 4)
        self.unused = nn.Linear(2, 2) if unused else None
        self.checkpointed = checkpointed

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x))).flatten(1)
        if self.checkpointed:  # reentrant: the block's hooks fire in a nested backward pass
            h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.mid(t)), h, use_reentrant=True)
        else:
            h = torch.tanh(self.mid(h))
        return self.head(h)


def _net(seed, **kw):
    torch.manual_seed(seed)
    return Net(**kw).to(CUDA, memory_format=torch.channels_last)


def _batch(step, size, device=None):
    device = CUDA if device is None else device
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(size, 3, 6, 6, generator=g).to(device), torch.randn(size, 4, generator=g).to(device)


def _close(a, b, what, tol=1e-5):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=lambda m: f"{what} {name}: {m}")


def _oracle(rank, world_size, nccl, as_view=True, bn=False, unused=False, checkpointed=False, accumulate=1,
            reduce_dtype=None, hook=True, steps=3):
    """MiniDDP against one process on the whole batch (and torch's DDP where it can run the same)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from minddp import MiniDDP
    from minddp.ddp import default_hooks as minddp_hooks

    if nccl:
        _nccl()
    kw = dict(bn=bn, unused=unused, checkpointed=checkpointed)
    mini = MiniDDP(_net(rank, **kw), device_ids=[CUDA], gradient_as_bucket_view=as_view, bucket_cap_mb=1e-3,
                   find_unused_parameters=unused, static_graph=checkpointed, reduce_dtype=reduce_dtype)
    models = {"minddp": mini}
    if not checkpointed:  # torch's DDP cannot compare there without static_graph; the reference does
        models["torch"] = TorchDDP(_net(rank, **kw), device_ids=[0], gradient_as_bucket_view=as_view,
                                   bucket_cap_mb=1e-3, find_unused_parameters=unused)
    if not bn:  # BatchNorm normalizes each rank's shard: no single-process equal
        models["reference"] = _net(0, **kw)
    if hook and world_size == 1:  # both communicate at world size 1
        mini.register_comm_hook(None, minddp_hooks.allreduce_hook)
        if "torch" in models:
            models["torch"].register_comm_hook(None, default_hooks.allreduce_hook)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for k, m in models.items()}
    for step in range(steps):
        for opt in opts.values():
            opt.zero_grad(set_to_none=step % 2 == 0)
        for micro in range(accumulate):
            x, y = _batch(10 * step + micro, PER_RANK * world_size)
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            for name, model in models.items():
                xb, yb = (x, y) if name == "reference" else (x[mine], y[mine])
                if name != "reference" and micro < accumulate - 1:
                    with model.no_sync():
                        (F.mse_loss(model(xb), yb) / accumulate).backward()
                else:
                    (F.mse_loss(model(xb), yb) / accumulate).backward()
        w = mini.module.conv.weight
        assert w.grad.stride() == w.stride(), f"channels_last .grad strides {w.grad.stride()} != {w.stride()}"
        for opt in opts.values():
            opt.step()
        tol = 1e-5 if reduce_dtype is None else 2e-3
        for name, model in models.items():
            if name != "minddp":
                _close(mini.module, getattr(model, "module", model), f"step {step} vs {name}", tol)


@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "view"])
def test_nccl_world1_with_a_communicating_hook(nccl1, as_view):
    nccl1.run(_oracle, True, as_view, timeout_s=120)


@pytest.mark.parametrize("case", [dict(as_view=False), dict(as_view=True), dict(bn=True), dict(unused=True),
                                  dict(accumulate=3), dict(checkpointed=True), dict(reduce_dtype=torch.float64)],
                         ids=["copy", "view", "batchnorm_buffers", "find_unused", "no_sync", "static_graph_ckpt",
                              "reduce_dtype"])
def test_gloo_two_ranks_cuda_tensors_oracle(gloo2, case):
    gloo2.run(_oracle, False, **case, timeout_s=180)


@pytest.mark.parametrize("case", [dict(unused=True), dict(checkpointed=True), dict(bn=True)],
                         ids=["find_unused", "static_graph_ckpt", "batchnorm_buffers"])
def test_nccl_world1_options(nccl1, case):
    nccl1.run(_oracle, True, **case, timeout_s=120)


# -------------------------------------------------------------- streams
def _late_result_hook(state, bucket):
    """All-reduce, then produce the result late on a side stream (which the callback's stream then waits for)."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

    def late(f):
        t = f.value()[0]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # tens of ms of GPU time before the value exists
            out = t * 1.0
        torch.cuda.current_stream().wait_stream(side)
        out.record_stream(torch.cuda.current_stream())
        return out

    return fut.then(late)


def _stream_canary(rank, world_size, user_stream):
    from minddp import MiniDDP

    _nccl()
    mini = MiniDDP(_net(0), gradient_as_bucket_view=True)
    mini.register_comm_hook(None, _late_result_hook)
    reference = _net(0)
    x, y = _batch(0, PER_RANK)
    stream = torch.cuda.Stream() if user_stream else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        F.mse_loss(mini(x), y).backward()
        F.mse_loss(reference(x), y).backward()
        grads = [p.grad.clone() for p in mini.parameters()]  # read at once, on the user's stream
    torch.cuda.synchronize()
    for g, q in zip(grads, reference.parameters()):
        torch.testing.assert_close(g, q.grad)


@pytest.mark.parametrize("user_stream", [False, True], ids=["default_stream", "user_side_stream"])
def test_a_late_hook_result_still_reaches_grad(nccl1, user_stream):
    nccl1.run(_stream_canary, user_stream, timeout_s=120)


# ---------------------------------------------------- AMP, sparse, join
def _amp(rank, world_size):
    from minddp import MiniDDP
    from minddp.ddp import default_hooks as minddp_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    _nccl()
    mini, native = MiniDDP(_net(0)), TorchDDP(_net(0), device_ids=[0])
    mini.register_comm_hook(None, minddp_hooks.allreduce_hook)
    native.register_comm_hook(None, default_hooks.allreduce_hook)
    pairs = [(m, torch.optim.SGD(m.parameters(), lr=0.05), torch.amp.GradScaler("cuda")) for m in (mini, native)]
    for step in range(3):
        x, y = _batch(step, PER_RANK)
        for model, opt, scaler in pairs:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    _close(mini.module, native.module, "AMP vs torch DDP", 1e-3)


def test_amp_with_grad_scaler(nccl1):
    nccl1.run(_amp, timeout_s=120)


def _sparse(rank, world_size, nccl):
    from minddp import MiniDDP

    if nccl:
        _nccl()
    torch.manual_seed(0)
    reference = nn.EmbeddingBag(50, 8, mode="sum", sparse=True).to(CUDA)
    torch.manual_seed(rank)
    mini = MiniDDP(nn.EmbeddingBag(50, 8, mode="sum", sparse=True).to(CUDA))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, mini)]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 50, (world_size * PER_RANK, 3), generator=g).to(CUDA)
        for opt in opts:
            opt.zero_grad()
        reference(idx).pow(2).mean().backward()
        mini(idx[rank * PER_RANK : (rank + 1) * PER_RANK]).pow(2).mean().backward()
        assert mini.module.weight.grad.is_sparse
        for opt in opts:
            opt.step()
    torch.testing.assert_close(mini.module.weight, reference.weight)


def test_sparse_embeddings_nccl_world1(nccl1):
    nccl1.run(_sparse, True, timeout_s=120)


def test_sparse_embeddings_gloo_cuda(gloo2):
    gloo2.run(_sparse, False, timeout_s=120)


def _join(rank, world_size):
    from minddp import MiniDDP

    mini = MiniDDP(_net(rank))
    opt = torch.optim.SGD(mini.parameters(), lr=0.05)
    with mini.join():
        for step in range(2 + rank):  # rank 1 has a batch more
            x, y = _batch(step, PER_RANK)
            opt.zero_grad()
            F.mse_loss(mini(x), y).backward()
            opt.step()
    return [p.detach().cpu() for p in mini.parameters()]


def test_join_gloo_cuda(gloo2):
    a, b = gloo2.run(_join, timeout_s=120)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q)


# ------------------------------------------------------------ host syncs
def _syncs_in(fn) -> int:
    """How many synchronizing CUDA calls ``fn`` makes (torch's sync debug mode)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # (not the notice that the mode is a prototype, which also says "synchronizing")
    return sum("called a synchronizing" in str(w.message) for w in caught)


def _steady_state_syncs(rank, world_size, under_join):
    from minddp import MiniDDP
    from minddp.ddp import default_hooks as minddp_hooks

    _nccl()
    mini = MiniDDP(_net(0), gradient_as_bucket_view=True)
    mini.register_comm_hook(None, minddp_hooks.allreduce_hook)
    opt = torch.optim.SGD(mini.parameters(), lr=0.05)
    x, y = _batch(0, PER_RANK)

    def step():
        F.mse_loss(mini(x), y).backward()

    counts = []
    with mini.join(enable=under_join):
        for _ in range(4):
            opt.zero_grad()
            counts.append(_syncs_in(step))
            opt.step()
    torch.cuda.synchronize()
    return counts[2:]  # after the bucket rebuild


@pytest.mark.parametrize("under_join", [False, True], ids=["plain", "join"])
def test_no_host_sync_in_the_gradient_path(nccl1, under_join):
    assert nccl1.run(_steady_state_syncs, under_join, timeout_s=120)[0] == [0, 0]


def _desync_check_syncs(rank, world_size):
    from minddp.ddp.replicas import check_replicas_in_sync

    _nccl()
    model = _net(0)
    check_replicas_in_sync(model)
    return _syncs_in(lambda: check_replicas_in_sync(model))


def test_desync_check_waits_once(nccl1):
    assert nccl1.run(_desync_check_syncs, timeout_s=120)[0] <= 1  # one per tensor (8) before


# ------------------------------------------------- devices, device_ids
def _cpu_inputs_with_device_ids(rank, world_size):
    from minddp import MiniDDP

    _nccl()
    for ids in ([0], [CUDA], [torch.device("cuda")], ["cuda:0"]):
        mini = MiniDDP(_net(0), device_ids=ids)
        x, y = _batch(0, PER_RANK, device="cpu")
        out = mini(x)  # moved to device_ids[0], as torch's DDP does
        assert out.device == CUDA
        F.mse_loss(out, y.to(CUDA)).backward()


def test_cpu_inputs_with_device_ids(nccl1):
    nccl1.run(_cpu_inputs_with_device_ids, timeout_s=120)


def _no_set_device(rank, world_size):
    import os

    from minddp import MiniDDP

    dist.init_process_group("nccl", rank=rank, world_size=world_size, init_method="env://")
    assert torch.cuda.current_device() == 0  # nobody set it
    mini = MiniDDP(_net(0).to(torch.device("cuda", rank)), device_ids=[rank], trace=True)
    x, y = _batch(0, PER_RANK, device=torch.device("cuda", rank))
    F.mse_loss(mini(x), y).backward()
    mini.tracer.export_chrome_trace(os.devnull)  # an object collective, on each rank's own GPU
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one NCCL rank each); this machine has fewer")
def test_tutorial_form_without_set_device_on_two_gpus():
    with RankPool(2, init_group=False) as pool:
        pool.run(_no_set_device, timeout_s=120)


# ------------------------------------------------------- device-side trace
def _traced_late_hook(rank, world_size, path):
    from minddp import MiniDDP
    from minddp_lab.trace_view import read_steps

    _nccl()
    mini = MiniDDP(_net(0), trace=True, bucket_cap_mb=1e-3)
    mini.register_comm_hook(None, _late_result_hook)
    for step in range(3):
        F.mse_loss(mini(_batch(step, PER_RANK)[0]), _batch(step, PER_RANK)[1]).backward()
    mini.tracer.clear()
    x, y = _batch(9, PER_RANK)
    F.mse_loss(mini(x), y).backward()
    trace = mini.tracer.chrome_trace()
    if path:
        import json

        with open(path, "w") as f:
            json.dump(trace, f)
    (view,) = read_steps(trace)[0]
    # Each bucket's result comes >= ~10 ms of GPU time after launch (the hook's sleep);
    # an NCCL future completes on the CPU when queued, so CPU times would say ~0.
    return [b.finished_ms - b.launched_ms for b in view.buckets], trace["otherData"]["clock"]


def test_trace_times_are_device_times(nccl1):
    durations, clock = nccl1.run(_traced_late_hook, None, timeout_s=120)[0]
    assert clock == "cuda events"
    assert durations and min(durations) > 5.0, durations
