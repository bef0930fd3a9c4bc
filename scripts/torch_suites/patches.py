"""What ``run.py`` changes in torch's test files before running them.

Two kinds of change, both installed before a test file is imported (its
``from ... import`` lines copy names) and again in every rank the tests spawn
(the ranks re-import the runner, which reads :data:`IMPL_ENV`):

1. **The class under test.** ``torch.nn.parallel.DistributedDataParallel`` (and,
   for the ``minddp`` run, ``torch.distributed.optim.ZeroRedundancyOptimizer``)
   is replaced by the implementation being tested. The control run keeps
   torch's classes and goes through the very same patches, so a difference
   between the two runs is a difference between the implementations.

2. **GPU-only tests run on the CPU.** torch marks most of DDP's tests as
   needing one GPU per rank (``skip_if_lt_x_gpu(2)`` with 2 ranks,
   ``skip_if_no_gpu``), although what
   they check (gradients, hooks, checkpointing, unused parameters) does not
   depend on the device. Such a test runs here with every accelerator device
   it names mapped to the CPU: an integer device or ``"cuda:N"`` given to a
   tensor factory, ``Tensor.to`` or ``Module.to`` means ``"cpu"``;
   ``torch.accelerator.set_device_index``, ``torch.cuda.set_device`` and
   ``torch.cuda.synchronize`` do nothing, ``torch.cuda.current_device()`` is 0; the suites' ``gpus_for_rank`` (``init_multigpu_helper`` in
   ``distributed_test.py``) gives each rank one device, its rank (then mapped to the
   CPU) and their ``device_type`` is ``"cpu"``; and DDP's ``device_ids`` /
   ``output_device`` are dropped for a module on the CPU (torch refuses them
   there). Tests that need *more than one* device per rank
   (``skip_if_lt_x_gpu(n)`` with ``n`` above the two ranks: model parallelism,
   multi-device modules) are left to skip: their substance is the devices.
   So are tests marked ``requires_accelerator_dist_backend``: they need NCCL
   (torch's ZeRO refuses ``overlap_with_ddp`` on Gloo, "may meet hangs").

3. **Shims, for the minddp run only** (off with ``TORCH_SUITES_SHIMS=0``).
   A few tests call a torch-private method in passing, to check something
   beside their point: ``_get_ddp_logging_data()["static_graph"]`` after
   building a model with ``static_graph=...``, or ZeRO's ``_all_params`` to
   set gradients. minddp gets these two names, answered from its public
   state only, so the test's real subject (checkpointing, uneven inputs) is
   what decides; every use is logged and the table marks the test. And
   ``torch.nn.SyncBatchNorm`` becomes ``minddp.SyncBatchNorm`` (torch's is
   GPU-only, minddp's also works on CPU).

And one change of speed only: the ranks of a test start by ``fork`` instead
of torch's ``spawn``, so each inherits the imported torch and the patches
instead of importing them again (about 15 s a test less on a 2-core machine).
"""

from __future__ import annotations

import functools
import os
import sys
import unittest
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

IMPL_ENV = "TORCH_SUITES_IMPL"  # "torch" (the control) or "minddp"
SHIMS_ENV = "TORCH_SUITES_SHIMS"  # "0": no shims for torch-private names
SHIM_LOG_ENV = "TORCH_SUITES_SHIM_LOG"  # a file: one line "test id<TAB>shim" per use
CURRENT_TEST_ENV = "TORCH_SUITES_TEST"  # set by the runner before each test; forked ranks inherit it
IMPLS = ("torch", "minddp")
RANKS_PER_TEST = 2  # the DDP tests' world size; more GPUs than this means several per rank
CPU = torch.device("cpu")


def _is_accelerator(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, (str, torch.device)):
        try:
            return torch.device(device).type not in ("cpu", "meta")
        except RuntimeError:
            return False
    return False


class CpuDevices(TorchFunctionMode):
    """Every accelerator device a torch function is asked for becomes the CPU."""

    _MOVES = {torch.Tensor.to}
    _TO_ACCELERATOR = {torch.Tensor.cuda}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._TO_ACCELERATOR:
            return args[0].to(CPU)
        if _is_accelerator(kwargs.get("device")):
            kwargs["device"] = CPU
        if func in self._MOVES:
            args = tuple(CPU if i > 0 and _is_accelerator(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


def _does_nothing(name: str) -> Callable:
    """``name`` (selecting or waiting for an accelerator device) in a test moved to the CPU: nothing to do.

    A new function for each name: ``torch.compile`` keeps one rule per torch function object
    and refuses the same object under two names.
    """

    def nothing(*_args: Any, **_kwargs: Any) -> None:
        pass

    nothing.__name__ = nothing.__qualname__ = name
    return nothing


# The device calls a GPU-only test makes outside tensor functions, and what they do on the CPU.
DEVICE_CALLS_ON_CPU = (
    (torch.accelerator, "set_device_index", _does_nothing("set_device_index")),
    (torch.cuda, "set_device", _does_nothing("set_device")),
    (torch.cuda, "synchronize", _does_nothing("synchronize")),
    (torch.cuda, "current_device", lambda: 0),  # device 0, which CpuDevices makes the CPU
)


def on_cpu(test: Callable) -> Callable:
    """Run ``test`` with accelerator devices mapped to the CPU (see the module docstring)."""

    @functools.wraps(test)
    def run_on_cpu(*args, **kwargs):
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in DEVICE_CALLS_ON_CPU]
        for owner, name, replacement in DEVICE_CALLS_ON_CPU:
            setattr(owner, name, replacement)
        try:
            with CpuDevices():
                return test(*args, **kwargs)
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)

    run_on_cpu.retargeted_to_cpu = True
    return run_on_cpu


def needs_accelerator_backend(backends: Any = None) -> Callable:
    """torch's ``requires_accelerator_dist_backend``, asked at run time: is there an accelerator?

    torch's own asks whether NCCL was compiled in, which a CUDA wheel on a
    machine without a GPU answers yes; the test then fails, not skips.
    """
    return unittest.skipUnless(torch.accelerator.is_available(), "needs an accelerator communication backend")


def retarget_lt_x_gpu(original: Callable) -> Callable:
    """torch's ``skip_if_lt_x_gpu(x)``, but a test asking for one GPU per rank (or fewer) runs on the CPU."""

    def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = False):
        if x <= RANKS_PER_TEST:
            return on_cpu
        return original(x, allow_cpu=allow_cpu)

    return skip_if_lt_x_gpu


def _retarget_decorators() -> None:
    """Replace torch's GPU skip decorators (before the test files import them)."""
    import torch.testing._internal.common_distributed as common_distributed

    common_distributed.skip_if_lt_x_gpu = retarget_lt_x_gpu(common_distributed.skip_if_lt_x_gpu)
    common_distributed.skip_if_no_gpu = on_cpu
    common_distributed.requires_accelerator_dist_backend = needs_accelerator_backend


def retarget_suite_module(module: Any) -> None:
    """A torch test file's own device selection, once it is imported: one CPU device per rank."""
    if hasattr(module, "gpus_for_rank"):
        module.gpus_for_rank = lambda world_size: [[rank] for rank in range(world_size)]
    if getattr(module, "device_type", "cpu") != "cpu":
        module.device_type = "cpu"


def _start_ranks_by_fork() -> None:
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    def _spawn_processes(self) -> None:  # torch's name: the test classes call it in setUp
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    MultiProcessTestCase._spawn_processes = _spawn_processes


def findable(cls: type, module_name: str, qualname: str) -> type:
    """``cls``, made findable by pickle as ``module_name.qualname`` (``torch.save`` of a whole model)."""
    cls.__module__, cls.__qualname__ = module_name, qualname
    setattr(sys.modules[module_name], qualname, cls)
    return cls


def _on_cpu(module: torch.nn.Module) -> bool:
    tensors = list(module.parameters()) + list(module.buffers())
    return all(t.device.type == "cpu" for t in tensors)


def cpu_ddp(ddp_class: type) -> type:
    """``ddp_class`` that drops ``device_ids`` and ``output_device`` for a module on the CPU."""

    class CpuRetargetedDDP(ddp_class):
        def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
            if _on_cpu(module):
                device_ids, output_device = None, None
            super().__init__(module, device_ids, output_device, *args, **kwargs)

    CpuRetargetedDDP.__name__ = ddp_class.__name__
    return findable(CpuRetargetedDDP, __name__, f"Cpu{ddp_class.__qualname__}")


def _record_shim(name: str) -> None:
    path = os.environ.get(SHIM_LOG_ENV)
    if path:
        with open(path, "a") as log:
            log.write(f"{os.environ.get(CURRENT_TEST_ENV, '?')}\t{name}\n")


def with_ddp_shims(ddp_class: type) -> type:
    """MiniDDP plus torch's private ``_get_ddp_logging_data``, from MiniDDP's public arguments."""

    class WithShims(ddp_class):
        def _get_ddp_logging_data(self) -> dict:
            _record_shim("_get_ddp_logging_data")
            return {"static_graph": int(self.static_graph), "is_multi_device_module": 0}

    WithShims.__name__ = ddp_class.__name__
    return findable(WithShims, __name__, f"Shimmed{ddp_class.__qualname__}")


def with_zero_shims(zero_class: type) -> type:
    """minddp's ZeRO plus torch's private ``_all_params``: every parameter it was given."""

    class WithShims(zero_class):
        @property
        def _all_params(self) -> list:
            _record_shim("_all_params")
            return [p for group in self.param_groups for p in group["params"]]

    WithShims.__name__ = zero_class.__name__
    return findable(WithShims, __name__, f"Shimmed{zero_class.__qualname__}")


def _swap_classes(impl: str) -> None:
    import torch.distributed.optim
    import torch.nn.parallel

    if impl == "minddp":
        from minddp import MiniDDP, SyncBatchNorm
        from minddp.zero import ZeroRedundancyOptimizer

        ddp_class: type = MiniDDP
        zero_class: type = ZeroRedundancyOptimizer
        if os.environ.get(SHIMS_ENV, "1") != "0":
            ddp_class, zero_class = with_ddp_shims(ddp_class), with_zero_shims(zero_class)
            torch.nn.SyncBatchNorm = SyncBatchNorm
        torch.distributed.optim.ZeroRedundancyOptimizer = zero_class
    else:
        ddp_class = torch.nn.parallel.DistributedDataParallel
    torch.nn.parallel.DistributedDataParallel = cpu_ddp(ddp_class)


_installed: str | None = None


def install(impl: str, swap_classes: bool = True) -> None:
    """Install every patch for ``impl`` in this process (once), and tell spawned ranks to do the same.

    ``swap_classes=False``: the caller puts the classes under test in place itself, test by test.
    """
    global _installed
    if impl not in IMPLS:
        raise ValueError(f"{IMPL_ENV} must be one of {IMPLS}, got {impl!r}")
    if _installed is not None:
        if _installed != impl:
            raise RuntimeError(f"patches for {_installed!r} are already installed; one implementation per process")
        return
    os.environ[IMPL_ENV] = impl
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")  # a hang fails after 2 minutes
    _retarget_decorators()
    if swap_classes:
        _swap_classes(impl)
    if sys.platform == "linux":
        _start_ranks_by_fork()
    _installed = impl
