"""Lightning Fabric with MiniDDP (``minddp.frameworks.fabric.MiniDDPStrategy``, as ``docs/frameworks.md``
tells a user) against Fabric's ``ddp`` with torch's DDP: 2 CPU ranks, ``no_backward_sync``, gradient
clipping, a checkpoint saved and resumed; every step's loss, parameters and buffers bitwise equal on each
rank. And ``use_minddp()``, which cannot reach Fabric's or Lightning's own ``DDPStrategy``, refuses to let
them build torch's DDP in silence."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from minddp.launch import find_free_port  # below the ephemeral range, where Gloo's own connections cannot take it

pytest.importorskip("lightning_fabric", reason="Lightning not installed: pip install -e \".[frameworks]\" from a clone")

RUN = Path(__file__).parent / "frameworks" / "fabric_run.py"
ROOT = Path(__file__).resolve().parents[2]


CASES = [("lightning_fabric", "32-true"), ("lightning.fabric", "bf16-mixed")]


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory) -> list[dict]:
    """Every case, torch's DDP and MiniDDP, in one launch of 2 ranks (Lightning's startup is most of the cost)."""
    out = tmp_path_factory.mktemp("fabric")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(find_free_port()), str(RUN), str(out), *(f"{p}:{q}" for p, q in CASES)]
    done = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"the Fabric runs failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return [torch.load(out / f"rank{rank}.pt") for rank in (0, 1)]


def _assert_same_steps(mine: list[dict], torchs: list[dict], when: str) -> None:
    assert len(mine) == len(torchs) > 0, when
    for step, (a, b) in enumerate(zip(mine, torchs)):
        assert torch.equal(a["loss"], b["loss"]), f"{when} step {step}: loss {a['loss']} vs torch {b['loss']}"
        for name in b["state"]:
            assert torch.equal(a["state"][name], b["state"][name]), f"{when} step {step}: {name}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("package, precision", CASES)
def test_fabric_with_minddp_equals_fabric_with_torchs_ddp(fabric_runs, package, precision):
    for rank, runs in enumerate(fabric_runs):
        mine, torchs = runs[package, precision, "minddp"], runs[package, precision, "torch"]
        assert mine["wrapper"] == "MiniDDP" and torchs["wrapper"] == "DistributedDataParallel", (mine["wrapper"],
                                                                                                 torchs["wrapper"])
        _assert_same_steps(mine["first"], torchs["first"], f"rank {rank}")
        _assert_same_steps(mine["resumed"], torchs["resumed"], f"rank {rank}, resumed")
        _assert_same_steps(mine["resumed"], mine["first"][2:], f"rank {rank}, resumed against the first run")


# ------------------------------------------------- use_minddp() where it cannot reach
def _fabric_builds(package: str):
    strategy = __import__(f"{package}.strategies.ddp", fromlist=["DDPStrategy"]).DDPStrategy(
        parallel_devices=[torch.device("cpu")])
    return lambda module: strategy.setup_module(module)


def _lightning_builds(package: str):
    strategy = __import__(f"{package}.strategies.ddp", fromlist=["DDPStrategy"]).DDPStrategy(
        parallel_devices=[torch.device("cpu")])
    return lambda module: strategy._setup_model(module)


@pytest.mark.parametrize("builds, package, fix", [
    (_fabric_builds, "lightning_fabric", "minddp.frameworks.fabric"),
    (_fabric_builds, "lightning.fabric", "minddp.frameworks.fabric"),
    (_lightning_builds, "pytorch_lightning", "minddp.frameworks.lightning"),
    (_lightning_builds, "lightning.pytorch", "minddp.frameworks.lightning"),
])
def test_use_minddp_refuses_a_strategy_that_would_build_torchs_ddp_naming_the_door(builds, package, fix):
    """Lightning's and Fabric's ``DDPStrategy`` imported torch's class by name: after ``use_minddp()`` they
    would still train with torch's DDP. Building it raises instead, naming the strategy to use; after
    ``use_torch_ddp()``, torch's DDP is built again (here it then fails for want of a process group)."""
    from minddp.frameworks.accelerate import use_minddp, use_torch_ddp

    build = builds(package)
    use_minddp()
    try:
        with pytest.raises(RuntimeError, match="use_minddp") as refused:
            build(nn.Linear(2, 2))
    finally:
        use_torch_ddp()
    assert fix in str(refused.value) and package in str(refused.value), refused.value
    with pytest.raises((RuntimeError, ValueError)) as torchs:
        build(nn.Linear(2, 2))
    assert "use_minddp" not in str(torchs.value), torchs.value


def test_use_minddp_refuses_torchs_class_taken_by_name_elsewhere_naming_the_caller():
    from torch.nn.parallel.distributed import DistributedDataParallel

    from minddp.frameworks.accelerate import use_minddp, use_torch_ddp

    use_minddp()
    try:
        with pytest.raises(RuntimeError, match=__name__) as refused:
            DistributedDataParallel(nn.Linear(2, 2))
    finally:
        use_torch_ddp()
    assert "minddp.MiniDDP" in str(refused.value), refused.value  # the fix: MiniDDP built there


@pytest.mark.parametrize("door", ["minddp.frameworks.fabric", "minddp.frameworks.lightning"])
def test_a_strategy_with_both_lightning_packages_imported_asks_which_naming_package(door):
    """``lightning_fabric`` and ``lightning.fabric`` (``pytorch_lightning`` and ``lightning.pytorch``) hold
    different classes: with both imported, ``MiniDDPStrategy()`` cannot guess; ``package=`` settles it."""
    import importlib

    pytest.importorskip("lightning", reason="the unified lightning package not installed")
    import lightning  # noqa: F401
    import pytorch_lightning  # noqa: F401

    strategy = importlib.import_module(door)
    with pytest.raises(ValueError, match="package="):
        strategy.MiniDDPStrategy()
    for package in strategy.PACKAGES:
        chosen = strategy.MiniDDPStrategy(package=package)
        assert chosen.package == package and isinstance(chosen, strategy.MiniDDPStrategy)
        base = importlib.import_module(f"{package}.strategies.ddp").DDPStrategy
        assert isinstance(chosen, base)
