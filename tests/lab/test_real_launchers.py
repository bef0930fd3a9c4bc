"""The launch scripts users copy, run under the real programs: SLURM, OpenMPI's mpirun, two-node torchrun.

tests/lab/test_train.py fakes the launchers' environment variables; here the real
programs start the ranks. SLURM runs as a private one-node cluster
(tests/lab/slurm_cluster.py). A test whose programs are missing skips and says
which; ``bash scripts/ci_install_launchers.sh`` installs them (Debian, root).
Every run is two CPU ranks on Gloo with tiny synthetic data, each
subprocess under a timeout.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import torch

from slurm_cluster import SlurmCluster, free_port, missing_programs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SBATCH_SCRIPT = os.path.join(REPO, "scripts", "slurm_multinode.sbatch")
# 256 samples, global batch 32: 8 steps per epoch.
SMALL = ["--data", "synthetic", "--synthetic-size", "256", "--batch-size", "32", "--log-every", "4",
         "--timeout-s", "30"]
_LAUNCHER_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MINDDP_TEST_FAIL"}


def job_env(**extra) -> dict[str, str]:
    """This environment minus any launcher's variables, with this python and this checkout first."""
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(
        PATH=os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")])),
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",  # job logs show each line as it happens
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def checkpoint_step(directory) -> int:
    return torch.load(os.path.join(directory, "last.pt"), weights_only=True)["step"]


def logged_steps(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"step (\d+)/", text)]


def ok(result: subprocess.CompletedProcess) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"exit {result.returncode}\n{output}"
    return output


# --------------------------------------------------------------------------- SLURM


@pytest.fixture(scope="session")
def slurm():
    missing = missing_programs()
    if missing:
        pytest.skip(f"SLURM/munge not installed (missing {', '.join(missing)}): bash scripts/ci_install_launchers.sh")
    if os.geteuid() != 0:
        pytest.skip("a private SLURM cluster needs root (slurmd starts jobs as their user)")
    cluster = SlurmCluster.start()
    try:
        yield cluster
    finally:
        leftovers = cluster.stop()
    assert not leftovers, f"processes outlived the cluster's shutdown (killed): {leftovers}"


class Submission:
    """One ``sbatch scripts/slurm_multinode.sbatch`` on 2 CPU tasks, with a checkpoint folder."""

    def __init__(self, cluster: SlurmCluster, folder, *train_args: str):
        self.cluster, self.folder = cluster, str(folder)
        self.log = os.path.join(self.folder, f"job-{uuid.uuid4().hex[:6]}.out")
        env = job_env(SLURM_CONF=cluster.conf, CKPT_DIR=self.ckpt, MASTER_PORT=free_port())
        # A CPU-only cluster: the header's GPU, node and CPU requests are
        # overridden on the command line, not edited.
        self.job_id = cluster.run(
            "sbatch", "--parsable", "--export=ALL", "--gpus-per-node=0", "--nodes=1", "--ntasks-per-node=2",
            "--cpus-per-task=1", "--time=5", f"--output={self.log}", f"--chdir={self.folder}",
            SBATCH_SCRIPT, *train_args, env=env,
        ).stdout.strip().split(";")[0]

    @property
    def ckpt(self) -> str:
        return os.path.join(self.folder, "ckpt")

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()

    def wait(self, timeout: float = 60) -> str:
        state = self.cluster.wait_job(self.job_id, timeout)
        assert state == "COMPLETED", f"job {self.job_id} ended {state}\n{self.output()}"
        return self.output()


def test_slurm_job_trains_then_a_second_submission_resumes(slurm, tmp_path):
    first = Submission(slurm, tmp_path, *SMALL, "--epochs", "1").wait()
    assert "2 ranks on 1 nodes (gloo)" in first  # no GPU in the allocation: Gloo, by itself
    assert checkpoint_step(tmp_path / "ckpt") == 8

    # The same command with more epochs: --resume auto (in the script) finds last.pt.
    second = Submission(slurm, tmp_path, *SMALL, "--epochs", "2").wait()
    assert "resumed from" in second and "at step 8" in second, second
    assert logged_steps(second)[0] > 8, second  # counting continues from 8
    assert checkpoint_step(tmp_path / "ckpt") == 16


def test_slurm_job_cancelled_mid_epoch_resumes_from_its_last_checkpoint(slurm, tmp_path):
    # 4096 samples, global batch 8: 512 steps per epoch; a checkpoint every 5 steps.
    save_every, steps_per_epoch, max_steps = 5, 512, 500
    args = ["--data", "synthetic", "--synthetic-size", "4096", "--batch-size", "8", "--log-every", "1",
            "--timeout-s", "30", "--save-every", str(save_every), "--max-steps", str(max_steps)]
    job = Submission(slurm, tmp_path, *args)
    deadline = time.monotonic() + 60
    while not (os.path.exists(job.log) and max(logged_steps(job.output()), default=0) > save_every):
        state = slurm.job_state(job.job_id)
        assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, (
            f"job {job.job_id} is {state} before step {save_every + 1}\n{job.output() if os.path.exists(job.log) else ''}"
        )
        time.sleep(0.05)
    slurm.run("scancel", job.job_id)
    state = slurm.wait_job(job.job_id, timeout=30)
    assert state == "CANCELLED", f"job {job.job_id} ended {state} before it was cancelled"

    reached = max(logged_steps(job.output()))
    saved = checkpoint_step(job.ckpt)
    assert saved < steps_per_epoch  # mid-epoch
    assert 0 < saved <= reached and reached - saved <= save_every, (saved, reached, job.output())

    # Resubmitted (a few steps further, to keep the test short): it continues at `saved`.
    args[args.index("--max-steps") + 1] = str(saved + save_every)
    resumed = Submission(slurm, tmp_path, *args).wait()
    assert f"at step {saved}" in resumed, resumed
    assert logged_steps(resumed) == list(range(saved + 1, saved + save_every + 1)), resumed  # none skipped or redone
    assert checkpoint_step(job.ckpt) == saved + save_every
    # metrics.jsonl lost the rows of the steps after `saved` (they were redone) and repeats none.
    with open(os.path.join(job.ckpt, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, saved + save_every + 1))


# --------------------------------------------------------------------------- mpirun, torchrun


def test_mpirun_script_starts_two_ranks(tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("OpenMPI's mpirun not installed: bash scripts/ci_install_launchers.sh")
    # Oversubscribe: 2 ranks must start even on a one-core machine.
    env = job_env(NP=2, MASTER_PORT=free_port(), OMPI_MCA_rmaps_base_oversubscribe=1)
    result = subprocess.run(["bash", os.path.join(REPO, "scripts", "mpirun.sh"), *SMALL, "--max-steps", "4",
                             "--checkpoint-dir", str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    output = ok(result)
    assert "2 ranks" in output
    assert checkpoint_step(tmp_path) == 4


def test_torchrun_script_on_two_nodes_of_one_machine(tmp_path):
    # Two torchrun agents ("nodes"), one rank each, meeting over loopback
    # through the c10d rendezvous as they would across machines.
    env = job_env(NNODES=2, NPROC=1, MASTER_ADDR="127.0.0.1", RDZV_PORT=free_port(), RDZV_ID=uuid.uuid4().hex[:8])
    command = ["bash", os.path.join(REPO, "scripts", "torchrun.sh"), *SMALL, "--max-steps", "4",
               "--checkpoint-dir", str(tmp_path)]
    nodes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              stdin=subprocess.DEVNULL, start_new_session=True) for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
                node.wait()
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output
    assert "2 ranks" in "".join(outputs)
    assert checkpoint_step(tmp_path) == 4
