"""accelerate's own shipped test scripts (``accelerate/test_utils/scripts``), unmodified, on 2 CPU ranks,
with MiniDDP swapped in the way ``docs/frameworks.md`` tells a user to, and with torch's DDP as the
control: each must pass with both. (``test_distributed_data_loop.py`` is left out: on this CPU machine it
did not finish within 500 s with torch's DDP either.) ``test_sync.py`` is the one that caught ``trigger_sync_in_backward``
averaging nothing (its ``test_distributed_sync_multiple_fwd``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minddp.launch import find_free_port  # below the ephemeral range, where Gloo's own connections cannot take it

accelerate = pytest.importorskip("accelerate", reason="accelerate not installed: pip install -e \".[frameworks]\" from a clone")

SCRIPTS = Path(accelerate.__file__).parent / "test_utils" / "scripts"
RUN = Path(__file__).parent / "frameworks" / "accelerate_run.py"
ROOT = Path(__file__).resolve().parents[2]


def _run(which: str, script: str, tmp_path: Path, *flags: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(find_free_port()), str(RUN), which, str(SCRIPTS / script), *flags]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, f"{script} with {which}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("script, flags", [("test_sync.py", ()), ("test_script.py", ()),
                                           ("test_ddp_comm_hook.py", ("--cpu",))])
@pytest.mark.parametrize("which", ["torch", "minddp"])
def test_accelerates_script_passes(tmp_path, which, script, flags):
    _run(which, script, tmp_path, *flags)


LOOP = Path(__file__).parent / "frameworks" / "accelerate_loop.py"


@pytest.mark.timeout(300)
def test_accelerates_loop_with_minddp_equals_torchs_ddp(tmp_path):
    """accelerate's own loop (``accumulate``, ``clip_grad_norm_``, bf16, ``save_state`` / ``load_state``) with
    MiniDDP and with torch's DDP, in one launch: every micro-batch's loss, parameters and buffers bitwise equal
    on each rank, and the resumed run equal to the first one from where it was saved."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(find_free_port()), str(LOOP), str(tmp_path)]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"the loop failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    import torch

    for rank in (0, 1):
        runs = torch.load(tmp_path / f"rank{rank}.pt")
        mine, torchs = runs["minddp"], runs["torch"]
        assert (mine["wrapper"], torchs["wrapper"]) == ("MiniDDP", "DistributedDataParallel")
        pairs = [("first", mine["first"], torchs["first"]), ("resumed", mine["resumed"], torchs["resumed"]),
                 ("resumed against the first run", mine["resumed"], mine["first"][4:])]
        for when, ours, theirs in pairs:
            assert len(ours) == len(theirs) > 0, when
            for i, (a, b) in enumerate(zip(ours, theirs)):
                assert torch.equal(a["loss"], b["loss"]), f"rank {rank}, {when}, micro-batch {i}: loss"
                for name in b["state"]:
                    assert torch.equal(a["state"][name], b["state"][name]), f"rank {rank}, {when}, {i}: {name}"


def _kwargs_from_accelerate(rank, world_size):
    """``DistributedDataParallelKwargs(check_reduction=True, dim=1)``: accelerate passes both on (they are not
    its defaults); torch's DDP takes them (a FutureWarning for check_reduction), and so must MiniDDP."""
    import warnings

    import torch
    import torch.nn.functional as F
    from accelerate import DistributedDataParallelKwargs
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from minddp import MiniDDP

    kwargs = DistributedDataParallelKwargs(check_reduction=True, dim=1).to_kwargs()
    assert kwargs == {"check_reduction": True, "dim": 1}
    grads = {}
    for label, cls in (("minddp", MiniDDP), ("torch", TorchDDP)):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = cls(torch.nn.Linear(4, 2), **kwargs)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        F.mse_loss(model(x), torch.zeros(3, 2)).backward()
        grads[label] = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads["minddp"], grads["torch"]))


def test_ddp_kwargs_through_accelerate_are_taken_like_torch(ranks):
    import inspect

    from minddp import MiniDDP

    if not {"check_reduction", "dim"} <= set(inspect.signature(MiniDDP.__init__).parameters):
        pytest.skip("MiniDDP does not take check_reduction and dim (torch 2.15's arguments)")
    ranks(2).run(_kwargs_from_accelerate)
