"""The minddp-train program, run as a user runs it: exact resume, a killed rank, bad input, real launchers.

Every run is a subprocess with tiny synthetic data, a few steps and two CPU
ranks; ``subprocess.run(timeout=...)`` turns a hang into a failure.
"""

import os
import subprocess
import sys
import time

import pytest
import torch

from minddp.train.checkpoint import load_checkpoint, save_checkpoint
from minddp.launch import find_free_port

TRAIN = [sys.executable, "-m", "minddp.train"]
# 256 samples, global batch 32 -> 8 steps per epoch on any world size.
SMALL = ["--synthetic-size", "256", "--batch-size", "32", "--log-every", "4", "--timeout-s", "20"]
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "TORCHELASTIC_", "PMI_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MINDDP_TEST_FAIL"}


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)}
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def train(*args, env=None, timeout=60):
    return subprocess.run(
        TRAIN + [str(a) for a in args],
        env=env or _clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def params(directory):
    return load_checkpoint(str(directory))["model"]


# --------------------------------------------------------------------------- resume


def test_exact_resume_gives_identical_parameters(tmp_path):
    # 12 steps = one and a half epochs; the stop at step 5 is mid-epoch, so the
    # resumed run must skip the 5 batches already consumed, and restore both ranks' RNGs.
    common = ["--model", "cnn", "--epochs", "2", "--max-steps", "12", *SMALL]
    ok(train(*common, "--checkpoint-dir", tmp_path / "once"))
    ok(train(*common, "--max-steps", "5", "--checkpoint-dir", tmp_path / "twice", "--keep-checkpoints"))
    assert load_checkpoint(str(tmp_path / "twice"))["step"] == 5
    resumed = ok(train(*common, "--checkpoint-dir", tmp_path / "twice", "--resume"))
    assert "resumed from" in resumed.stdout and "at step 5" in resumed.stdout
    once, twice = params(tmp_path / "once"), params(tmp_path / "twice")
    assert load_checkpoint(str(tmp_path / "twice"))["step"] == 12
    for name in once:
        assert torch.equal(once[name], twice[name]), name
    # ...and the resume really trained: the parameters moved after step 5.
    at_five = load_checkpoint(str(tmp_path / "twice" / "step-5.pt"))["model"]
    assert any(not torch.equal(once[n], at_five[n]) for n in once)


# --------------------------------------------------------------------------- failures


def test_killed_rank_stops_the_job_and_resume_finishes_it(tmp_path):
    start = time.monotonic()
    result = train(
        "--epochs", "2", "--max-steps", "10", "--save-every", "3", "--checkpoint-dir", tmp_path, *SMALL,
        env=_clean_env(MINDDP_TEST_FAIL="1:8:kill"),
    )
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "rank 1 failed first" in result.stderr and "SIGKILL" in result.stderr, result.stderr
    assert "last good checkpoint" in result.stderr and "(step 6)" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr  # rank 0's consequential error is one line
    assert elapsed < 20 + 10 + 15  # --timeout-s, the grace, and start-up
    assert load_checkpoint(str(tmp_path))["step"] == 6
    resumed = ok(train("--epochs", "2", "--max-steps", "10", "--checkpoint-dir", tmp_path, "--resume", *SMALL))
    assert "at step 6" in resumed.stdout
    assert load_checkpoint(str(tmp_path))["step"] == 10


def test_raising_rank_reports_its_traceback_once():
    result = train("--max-steps", "6", *SMALL, env=_clean_env(MINDDP_TEST_FAIL="1:3:raise"))
    assert result.returncode == 1
    assert result.stderr.count("Traceback") == 1, result.stderr
    assert "rank 1 failed first" in result.stderr
    assert "RuntimeError: MINDDP_TEST_FAIL: rank 1 fails before step 3" in result.stderr


def _other_model_checkpoint(directory):
    save_checkpoint({"model": {}, "model_name": "ae", "step": 1}, str(directory))


def _corrupt_checkpoint(directory):
    os.makedirs(directory, exist_ok=True)
    (directory / "last.pt").write_bytes(b"\x00garbage, not a zip file" * 20)


@pytest.mark.parametrize(
    "args, prepare, message",
    [
        (["--data", "mnist", "--data-dir", "{tmp}/nowhere"], None, "MNIST folder .*nowhere does not exist"),
        (["--batch-size", "33"], None, "--batch-size 33 is the global batch, and 2 ranks do not divide it"),
        (["--resume", "--checkpoint-dir", "{tmp}/empty"], None, "--resume: no checkpoint to resume from"),
        (["--resume", "--checkpoint-dir", "{tmp}", "--nproc", "1"], _other_model_checkpoint,
         "written for model_name 'ae', not 'cnn'"),
        (["--resume", "--checkpoint-dir", "{tmp}", "--nproc", "1"], _corrupt_checkpoint,
         "not a readable checkpoint"),
    ],
    ids=["missing-mnist", "indivisible-batch", "resume-without-checkpoint", "other-model", "corrupt"],
)
def test_bad_input_gets_one_clear_line(tmp_path, capsys, monkeypatch, args, prepare, message):
    # In this process (main() is what the console script calls): the first three
    # are caught before any rank starts, the last two by the one rank of --nproc 1.
    import re

    from minddp.train import main

    for name in list(os.environ):
        if name in _LAUNCHER_NAMES or name.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    if prepare is not None:
        prepare(tmp_path)
    code = main(["--max-steps", "2", *[a.replace("{tmp}", str(tmp_path)) for a in args]])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minddp-train: error: "), err
    assert re.search(message, lines[0]), lines[0]


def test_bad_input_from_the_command_line():
    # The same through the real entry point: exit status 2, one line, no traceback.
    result = train("--batch-size", "0")
    assert result.returncode == 2
    assert result.stderr.strip() == "minddp-train: error: --batch-size must be positive, got 0"


# --------------------------------------------------------------------------- wrappers agree


def test_torch_ddp_and_minddp_reach_the_same_parameters(tmp_path):
    common = ["--model", "cnn", "--max-steps", "6", *SMALL]
    ok(train(*common, "--ddp", "mini", "--checkpoint-dir", tmp_path / "mini"))
    ok(train(*common, "--ddp", "torch", "--checkpoint-dir", tmp_path / "torch"))
    mini, theirs = params(tmp_path / "mini"), params(tmp_path / "torch")
    for name in mini:
        torch.testing.assert_close(mini[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)


# --------------------------------------------------------------------------- launchers


def _two_launched_ranks(make_env, tmp_path):
    port = find_free_port()
    procs = [
        subprocess.Popen(
            TRAIN + ["--max-steps", "2", *SMALL, "--checkpoint-dir", str(tmp_path)],
            env=_clean_env(**make_env(rank, port)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "2 ranks" in outs[0][0] and outs[1][0] == ""  # rank 0 talks, rank 1 stays quiet
    assert load_checkpoint(str(tmp_path))["world_size"] == 2


def test_under_faked_slurm(tmp_path):
    _two_launched_ranks(
        lambda rank, port: dict(
            SLURM_PROCID=rank, SLURM_NTASKS=2, SLURM_LOCALID=rank, SLURM_NODELIST="localhost", MASTER_PORT=port
        ),
        tmp_path,
    )


def test_under_faked_openmpi(tmp_path):
    _two_launched_ranks(
        lambda rank, port: dict(
            OMPI_COMM_WORLD_RANK=rank,
            OMPI_COMM_WORLD_SIZE=2,
            OMPI_COMM_WORLD_LOCAL_RANK=rank,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        ),
        tmp_path,
    )


def test_under_torchrun(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "minddp.train", "--max-steps", "2", *SMALL, "--checkpoint-dir", str(tmp_path)],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )
    ok(result)
    assert "2 ranks" in result.stdout
    assert load_checkpoint(str(tmp_path))["step"] == 2
