"""The part of DDP that frameworks reach past the public API for, against torch's DDP directly.

accelerate and Lightning drive DDP's flags and its reducer themselves
(``docs/frameworks.md`` lists every call); each test here does what one of
them does, on MiniDDP and on torch's DDP side by side, and compares the
gradients, buffers and what the call returns. No framework needed: the
frameworks' own code runs in ``tests/library/test_frameworks_*.py``.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _both(rank: int, **kwargs) -> dict[str, nn.Module]:
    return {"minddp": MiniDDP(_net(rank), **kwargs), "torch": TorchDDP(_net(rank), **kwargs)}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, their gradients and buffers, by name."""
    state = {name: t.detach().clone() for name, t in model.module.state_dict().items()}
    state.update({f"{name}.grad": p.grad.clone() for name, p in model.module.named_parameters() if p.grad is not None})
    return state


def _assert_same(states: dict[str, dict[str, torch.Tensor]], when: str) -> None:
    mini, native = states["minddp"], states["torch"]
    assert mini.keys() == native.keys(), when
    for name in native:
        torch.testing.assert_close(mini[name], native[name], rtol=0, atol=0, msg=lambda m: f"{when}, {name}: {m}")


# ------------------------------------ accelerate's trigger_sync_in_backward
def _accumulate_then_trigger(model, rank, step):
    """accelerate's ``Accelerator.trigger_sync_in_backward``: forwards under ``no_sync()``, then the flags
    set and ``reducer.prepare_for_backward([])``: the next backward must average."""
    x, y = _batch(rank, step)
    with model.no_sync():
        loss_a = F.mse_loss(model(x[:3]), y[:3])
        loss_b = F.mse_loss(model(x[3:]), y[3:])
    loss_a.backward()  # no communication: still inside accumulation
    model.require_backward_grad_sync = True
    model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    loss_b.backward()  # armed: averages everything accumulated


def _trigger_sync_in_backward(rank, world_size):
    states = {}
    for label, model in _both(rank).items():
        for step in range(3):
            _accumulate_then_trigger(model, rank, step)
        states[label] = _state(model)
    grads = [g for name, g in states["minddp"].items() if name.endswith(".grad")]
    gathered = [torch.cat([g.flatten() for g in grads]) for _ in range(world_size)]
    dist.all_gather(gathered, gathered[0].clone())
    assert torch.equal(gathered[0], gathered[1]), "MiniDDP: gradients differ between ranks after the armed backward"
    _assert_same(states, "after trigger_sync_in_backward")


def test_prepare_for_backward_arms_the_next_backward(ranks):
    ranks(2).run(_trigger_sync_in_backward)


def _trigger_with_unused_search(rank, world_size):
    """With find_unused_parameters, ``prepare_for_backward([])`` finds no output, so every parameter
    counts as unused: the gradients that then come are marked twice. torch raises; so must MiniDDP."""
    errors = {}
    for label, model in _both(rank, find_unused_parameters=True).items():
        with pytest.raises(RuntimeError) as raised:
            _accumulate_then_trigger(model, rank, 0)
        errors[label] = str(raised.value)
    return errors


def test_prepare_for_backward_without_outputs_under_unused_search_raises_like_torch(ranks):
    for errors in ranks(2).run(_trigger_with_unused_search):
        assert "ready only once" in errors["torch"]
        assert "ready only once" in errors["minddp"] or "twice" in errors["minddp"], errors["minddp"]


# --------------------- Lightning's manual optimization: the flag read at the end of forward
class _LowersSyncDuringForward(nn.Module):
    """What Lightning's ``_DDPForwardRedirection`` does under manual optimization: the wrapper's
    ``require_backward_grad_sync`` is lowered inside the forward (and raised again after it)."""

    def __init__(self, seed: int):
        super().__init__()
        self.net = _net(seed)
        self.wrapper = None  # set once wrapped (not a submodule: a plain attribute)

    def forward(self, x):
        out = self.net(x)
        self.__dict__["wrapper"].require_backward_grad_sync = False
        return out


def _lightning_manual_backward(model, loss):
    """Lightning's ``overrides.distributed.prepare_for_backward`` then ``loss.backward()``."""
    if torch.is_grad_enabled() and model.require_backward_grad_sync:
        model.require_forward_param_sync = True
        model.reducer._rebuild_buckets()
        model.reducer.prepare_for_backward([])
    else:
        model.require_forward_param_sync = False
    loss.backward()


def _manual_optimization(rank, world_size):
    """Steps where the backward is armed by hand, a step with no backward at all (torch then skips
    the next buffer broadcast: the flag read at the end of that forward was low), eval forwards."""
    states, flags = {}, {}
    for label, cls in (("minddp", MiniDDP), ("torch", TorchDDP)):
        inner = _LowersSyncDuringForward(rank)
        model = cls(inner)
        inner.__dict__["wrapper"] = model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        for step in range(5):
            x, y = _batch(rank, step)
            loss = F.mse_loss(model(x), y)
            seen.append(model.require_forward_param_sync)
            model.require_backward_grad_sync = True  # Lightning's on_after_outer_forward
            if step != 2:  # step 2: the training step returns without a backward
                _lightning_manual_backward(model, loss)
                optimizer.step()
                optimizer.zero_grad()
            with torch.no_grad():
                model.eval()
                model(x)
                model.train()
        states[label] = _state(model)
        flags[label] = seen
    assert flags["minddp"] == flags["torch"], flags
    _assert_same(states, "after manual optimization")


def test_sync_flag_is_read_at_the_end_of_forward_like_torch(ranks):
    ranks(2).run(_manual_optimization)


# ------------------------------------------------ what frameworks read
def _tower() -> nn.Module:
    torch.manual_seed(0)  # 1 MiB + 2 KiB of float32 gradients per layer: two buckets after the rebuild
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(3)], nn.BatchNorm1d(512))


def _logging_data(rank, world_size, hook=None, **kwargs):
    """``_get_ddp_logging_data()``: every key MiniDDP reports has torch's value, at construction and after
    each step (Lightning reads ``can_set_static_graph`` from it: absent on both here, so None)."""
    models = {"minddp": MiniDDP(_tower(), **kwargs), "torch": TorchDDP(_tower(), **kwargs)}
    for model in models.values():
        if isinstance(hook, dist.BuiltinCommHookType):
            model._register_builtin_comm_hook(hook)
        elif hook is not None:
            model.register_comm_hook(None, hook)
    reports = []
    for step in range(4):
        data = {label: model._get_ddp_logging_data() for label, model in models.items()}
        mine = data["minddp"]
        assert {k: data["torch"].get(k) for k in mine} == mine, f"step {step}"
        assert mine.get("can_set_static_graph") == data["torch"].get("can_set_static_graph")
        reports.append(mine)
        for model in models.values():
            model(torch.randn(4, 512)).sum().backward()
    return reports


def test_logging_data_holds_torchs_values_for_what_minddp_knows(ranks):
    reports = ranks(2).run(_logging_data)[0]
    assert reports[0]["world_size"] == 2 and reports[0]["module_name"] == "Sequential"
    assert "num_buckets_reduced" not in reports[0] and "num_buckets_reduced" not in reports[1]
    assert reports[2]["num_buckets_reduced"] == 1 and reports[3]["num_buckets_reduced"] == 2, reports  # 1 bucket, then 2


@pytest.mark.parametrize("hook", [allreduce_hook, dist.BuiltinCommHookType.FP16_COMPRESS])
def test_logging_data_names_the_comm_hook_as_torch(ranks, hook):
    reports = ranks(2).run(_logging_data, hook)[0]  # (every key MiniDDP reports is compared with torch's)
    assert "comm_hook" in reports[0]


def _caps(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    for kwargs in ({}, {"bucket_cap_mb": 25}, {"bucket_cap_mb": 0.5}, {"bucket_cap_mb_list": [0.5, 2]},
                   {"device_mesh": mesh}):
        mini, native = MiniDDP(_tower(), **kwargs), TorchDDP(_tower(), **kwargs)
        for name in ("bucket_bytes_cap", "bucket_bytes_cap_list", "bucket_bytes_cap_default", "device_ids"):
            assert getattr(mini, name) == getattr(native, name), f"{kwargs}: {name}"
        assert hasattr(mini, "device_mesh") == hasattr(native, "device_mesh"), kwargs
        if "device_mesh" in kwargs:
            assert mini.device_mesh is native.device_mesh is mesh


def test_bucket_caps_and_device_mesh_read_as_torchs(ranks):
    ranks(2).run(_caps)


def _rebuild_and_delay(rank, world_size):
    """Lightning calls ``reducer._rebuild_buckets()`` before each manual backward and, with
    ``static_graph``, ``reducer._delay_all_reduce()`` after the first one."""
    static = MiniDDP(_tower(), static_graph=True)
    with pytest.raises(RuntimeError, match=r"_delay_all_reduce\(\): only after the first backward"):
        static.reducer._delay_all_reduce()
    assert static.reducer._rebuild_buckets() is False  # no backward has shown the order yet: none due
    static(torch.randn(4, 512)).sum().backward()
    static.reducer._delay_all_reduce()  # the first backward's gradients are reduced already
    plain = MiniDDP(_tower())
    plain(torch.randn(4, 512)).sum().backward()
    with pytest.raises(RuntimeError, match=r"_delay_all_reduce\(\).*static_graph=False"):
        plain.reducer._delay_all_reduce()


def test_rebuild_buckets_and_delay_all_reduce_answer_or_refuse_by_name(ranks):
    ranks(2).run(_rebuild_and_delay)


def _rebuild_answers(rank, world_size):
    """``reducer._rebuild_buckets()`` at each point of the first steps, as Lightning's manual optimization
    calls it: what it answers, and the gradients after each step, MiniDDP beside torch's DDP."""
    answers, states = {}, {}
    for label, model in _both(rank).items():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        said = [model.reducer._rebuild_buckets()]  # before any backward
        for step in range(3):
            x, y = _batch(rank, step)
            loss = F.mse_loss(model(x), y)
            said.append(model.reducer._rebuild_buckets())  # after a forward, before its backward
            loss.backward()
            optimizer.step()
            said.append(model.reducer._rebuild_buckets())  # after the backward and the step
            optimizer.zero_grad()
        answers[label], states[label] = said, _state(model)
    assert answers["minddp"] == answers["torch"], answers
    _assert_same(states, "after three steps")


def test_rebuild_buckets_answers_true_once_after_the_first_backward_like_torch(ranks):
    ranks(2).run(_rebuild_answers)


# ------------------------------- buffer flags set on a built model
def _flag_switched(rank, world_size, name, before, after):
    """Frameworks set ``broadcast_buffers`` / ``forward_sync_buffers`` on a built model; torch's DDP reads the
    flag at every forward, so the next forward follows it. BatchNorm's running statistics after the same steps,
    and the flag read back, must be torch's on every rank."""
    states, read = {}, {}
    for label, model in _both(rank, forward_sync_buffers=before).items():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            if step == 1:
                setattr(model, name, after)
            x, y = _batch(rank, step)
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        read[label] = (model.broadcast_buffers, model.forward_sync_buffers)
        states[label] = _state(model)
    assert read["minddp"] == read["torch"] == (after, after), read
    _assert_same(states, f"rank {rank}, {name} switched from {before} to {after}")


@pytest.mark.parametrize("before, after", [(True, False), (False, True)])
@pytest.mark.parametrize("name", ["broadcast_buffers", "forward_sync_buffers"])
def test_buffer_flag_set_after_construction_acts_as_torchs(ranks, name, before, after):
    ranks(2).run(_flag_switched, name, before, after)
