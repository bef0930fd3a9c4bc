"""transformers' ``Trainer`` with MiniDDP (``use_minddp()``, as ``docs/frameworks.md`` tells a user) against the
same ``Trainer`` with torch's DDP: 2 CPU ranks, a tiny GPT-2 built from a config (nothing downloaded), every
logged loss and the final parameters bitwise equal on each rank, in each case of
``tests/library/frameworks/transformers_run.py`` (unused-parameter search off and on, activation checkpointing,
reentrant too, frozen layers, ``torch.compile``, save and resume). All cases run in one launch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minddp.launch import find_free_port  # below the ephemeral range, where Gloo's own connections cannot take it

pytest.importorskip("transformers", reason="transformers not installed: pip install -e \".[frameworks]\" from a clone")

RUN = Path(__file__).parent / "frameworks" / "transformers_run.py"
ROOT = Path(__file__).resolve().parents[2]
CASES = ["plain", "find_unused", "checkpointing", "checkpointing_reentrant", "frozen", "compile", "resume"]


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("transformers")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(find_free_port()), str(RUN), str(out), *CASES]
    done = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"the Trainer runs failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return [torch.load(out / f"rank{rank}.pt") for rank in (0, 1)]


@pytest.mark.timeout(450)
@pytest.mark.parametrize("case", CASES)
def test_trainer_with_minddp_equals_trainer_with_torchs_ddp(trainer_runs, case):
    for rank, runs in enumerate(trainer_runs):
        mine, torchs = runs[case, "minddp"], runs[case, "torch"]
        assert (mine["wrapper"], torchs["wrapper"]) == ("MiniDDP", "DistributedDataParallel"), case
        assert len(mine["losses"]) == len(torchs["losses"]) > 0, case
        assert mine["losses"] == torchs["losses"], f"rank {rank}, {case}: losses {mine['losses']} vs {torchs['losses']}"
        assert mine["state"].keys() == torchs["state"].keys()
        for name, value in torchs["state"].items():
            assert torch.equal(mine["state"][name], value), f"rank {rank}, {case}: {name}"
