"""Lightning's own Trainer (``pytorch_lightning.Trainer``, and the unified ``lightning.Trainer``) with MiniDDP (``minddp.frameworks.lightning.MiniDDPStrategy``, as
``docs/frameworks.md`` tells a user to swap it in) against Lightning's default ``ddp`` / ``ddp_spawn``
with torch's DDP: 2 CPU ranks, losses, parameters and buffers equal at every step, bitwise.
Each run is ``tests/library/frameworks/lightning_run.py`` in a fresh process (Lightning's ``ddp`` launches
rank 1 by running the script again)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning", reason="Lightning not installed: pip install -e \".[frameworks]\" from a clone")

RUN = Path(__file__).parent / "frameworks" / "lightning_run.py"
ROOT = Path(__file__).resolve().parents[2]


def _run(which: str, launch: str, mode: str, out: Path, package: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "PL_DISABLE_FORK": "1"}
    done = subprocess.run([sys.executable, str(RUN), which, launch, mode, str(out), package], env=env, cwd=out,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{which} {launch} {mode} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return [torch.load(path) for path in sorted(out.glob("fit*.pt"))]


@pytest.mark.timeout(600)  # four Lightning startups of 2 ranks each (about 2 min under a busy machine)
@pytest.mark.parametrize("launch, mode, package", [("ddp", "auto", "pytorch_lightning"),
                                                   ("ddp_spawn", "auto", "pytorch_lightning"),
                                                   ("ddp", "manual", "pytorch_lightning"),
                                                   ("ddp", "manual", "lightning.pytorch")])  # lightning.Trainer
def test_trainer_with_minddp_equals_trainer_with_torchs_ddp(tmp_path, launch, mode, package):
    runs = {}
    for which in ("torch", "minddp"):
        (tmp_path / which).mkdir()
        runs[which] = _run(which, launch, mode, tmp_path / which, package)
    assert len(runs["torch"]) == len(runs["minddp"]) == (2 if (launch, mode) == ("ddp", "auto") else 1)
    for fit, (mine, torchs) in enumerate(zip(runs["minddp"], runs["torch"]), 1):
        assert len(mine["steps"]) == len(torchs["steps"]) > 0
        for step, (a, b) in enumerate(zip(mine["steps"], torchs["steps"])):
            assert torch.equal(a["loss"], b["loss"]), f"fit {fit} step {step}: loss {a['loss']} vs torch {b['loss']}"
            for name in b["state"]:
                assert torch.equal(a["state"][name], b["state"][name]), f"fit {fit} step {step}: {name}"
        assert torch.equal(torch.stack(mine["val"]), torch.stack(torchs["val"])), f"fit {fit}: validation losses"
        for name in torchs["final"]:
            assert torch.equal(mine["final"][name], torchs["final"][name]), f"fit {fit}: final {name}"
