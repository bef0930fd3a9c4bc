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

accelerate = pytest.importorskip("accelerate", reason="accelerate not installed: pip install minddp[frameworks]")

SCRIPTS = Path(accelerate.__file__).parent / "test_utils" / "scripts"
RUN = Path(__file__).parent / "frameworks" / "accelerate_run.py"
ROOT = Path(__file__).parent.parent


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
        pytest.skip("MiniDDP does not take check_reduction and dim yet (torch 2.15's arguments)")
    ranks(2).run(_kwargs_from_accelerate)
