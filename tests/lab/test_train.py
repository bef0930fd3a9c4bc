"""The minddp-train program, run as a user runs it: exact resume, a killed rank, bad input, real launchers.

Every run is a subprocess with tiny synthetic data, a few steps and two CPU
ranks; ``subprocess.run(timeout=...)`` turns a hang into a failure.
"""

import functools
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minddp_lab.data import SyntheticMNIST
from minddp.ddp.wrapper import MiniDDP
from minddp.launch import find_free_port
from minddp_lab.models import build_model, model_loss
from minddp_lab.train.checkpoint import load_checkpoint, save_checkpoint
from minddp_lab.train.cli import build_parser
from minddp_lab.train.evaluate import evaluate, held_out_loader
from minddp_lab.train.metrics import read_metrics
from minddp_lab.train.step import accumulated_step

TRAIN = [sys.executable, "-m", "minddp_lab.train"]
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


def metric_rows(directory, key):
    return [row for row in read_metrics(os.path.join(directory, "metrics.jsonl")) if key in row]


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
    # The metrics file went on where the first part stopped (whose last step, 5,
    # has its own rows), with the same validation figures as one run.
    train_rows = [metric_rows(tmp_path / d, "loss") for d in ("once", "twice")]
    assert [r["step"] for r in train_rows[0]] == [4, 8, 12]
    assert [r["step"] for r in train_rows[1]] == [4, 5, 8, 12]
    once_val, twice_val = (metric_rows(tmp_path / d, "val_loss") for d in ("once", "twice"))
    assert [r["step"] for r in once_val] == [8, 12]  # each epoch's end, and the last step
    assert [r["step"] for r in twice_val] == [5, 8, 12] and twice_val[1:] == once_val
    # The default model visibly learns, even in 12 small steps.
    assert train_rows[0][-1]["loss"] < 0.7 * train_rows[0][0]["loss"], train_rows[0]


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

    from minddp_lab.train import main

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


def test_torchrun_restarts_a_killed_rank_and_loses_nothing(tmp_path):
    # Rank 1 is SIGKILLed once, before step 10; torchrun --max-restarts 1 starts
    # both ranks again with the same command line, and --resume auto continues
    # from the checkpoint of step 8. The end is the uninterrupted run's, bit for bit.
    common = ["--epochs", "2", "--max-steps", "12", *SMALL, "--log-every", "3"]
    ok(train(*common, "--checkpoint-dir", tmp_path / "once"))
    marker = tmp_path / "killed-once"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", "--monitor-interval", "0.1",
         "-m", "minddp_lab.train", *common, "--checkpoint-dir", str(tmp_path / "elastic"), "--save-every", "4",
         "--resume", "auto"],
        env=_clean_env(MINDDP_TEST_FAIL="1:10:kill", MINDDP_TEST_FAIL_ONCE=marker),
        capture_output=True,
        text=True,
        timeout=120,
    )
    ok(result)
    assert marker.exists(), "rank 1 was never killed"
    assert "no checkpoint at" in result.stdout and "starting fresh" in result.stdout  # the first attempt
    assert "resumed from" in result.stdout and "at step 8" in result.stdout, result.stdout  # the restart
    once, elastic = params(tmp_path / "once"), params(tmp_path / "elastic")
    for name in once:
        assert torch.equal(once[name], elastic[name]), name
    # Row 9 was written before the kill and again after the restart: kept once.
    steps = [r["step"] for r in metric_rows(tmp_path / "elastic", "loss")]
    assert steps == [3, 6, 9, 12], steps


# --------------------------------------------------------------------------- pieces, in process


def test_every_option_is_explained():
    for action in build_parser()._actions:
        assert action.help and len(action.help) > 15, action.option_strings


def _tiny_classifier():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 16), nn.Tanh(), nn.Linear(16, 10))


def _one_step(rank, world_size, k, clip):
    """Per model: its parameters after one accumulated step, and how many all-reduces the step made."""
    generator = torch.Generator().manual_seed(100 + rank)  # every rank its own samples
    images, labels = torch.rand(4 * k, 1, 28, 28, generator=generator), torch.randint(0, 10, (4 * k,), generator=generator)
    micro = [(images[4 * i : 4 * i + 4], labels[4 * i : 4 * i + 4]) for i in range(k)]
    results = []
    for batches in (micro, [(images, labels)]):  # K micro-batches of 4, then one batch of 4K
        model = _tiny_classifier()
        ddp_model = MiniDDP(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        calls, all_reduce = [], dist.all_reduce
        dist.all_reduce = lambda *a, **kw: calls.append(1) or all_reduce(*a, **kw)
        try:
            accumulated_step(ddp_model, batches, functools.partial(model_loss, "cnn"), optimizer,
                             torch.amp.GradScaler("cpu", enabled=False), clip_grad=clip)
        finally:
            dist.all_reduce = all_reduce
        results.append(([p.detach().clone() for p in model.parameters()], len(calls)))
    return results


@pytest.mark.parametrize("clip", [None, 0.01], ids=["plain", "clipped"])
def test_accumulated_micro_batches_equal_one_big_batch_with_fewer_all_reduces(ranks, clip):
    k = 4
    for (accumulated, accumulated_calls), (big, big_calls) in ranks(2).run(_one_step, k, clip):
        for a, b in zip(accumulated, big):
            torch.testing.assert_close(a, b)  # float32 sums in another order: default tolerances
        assert 1 <= accumulated_calls == big_calls < k  # one round of all-reduces per step, not per micro-batch
        if clip is not None:  # the update was clipped: SGD moved the parameters by lr * NORM in all
            moved = torch.cat([(p - p0).flatten() for p, p0 in zip(big, _tiny_classifier().parameters())])
            assert moved.norm().item() == pytest.approx(0.5 * clip, rel=1e-3)


def _model_with_running_stats(rank=0):
    torch.manual_seed(0)
    model = build_model("cnn")
    model(torch.rand(8, 1, 28, 28))  # a training-mode forward: BatchNorm's running statistics move
    if rank == 1:  # as if rank 1 had seen other batches: only rank 0's statistics may count
        for buffer in model.buffers():
            if buffer.is_floating_point():
                buffer.add_(0.5)
    return model


def _evaluate_on_ranks(rank, world_size, size):
    loader = held_out_loader(SyntheticMNIST(size=size, train=False), 4, rank, world_size)
    return evaluate(_model_with_running_stats(rank), "cnn", loader, torch.device("cpu"))


def test_evaluation_over_ranks_equals_one_process_on_the_whole_held_out_set(ranks):
    size = 37  # two ranks do not divide it: one rank gets one sample more, none is counted twice
    alone = evaluate(_model_with_running_stats(), "cnn", held_out_loader(SyntheticMNIST(size=size, train=False), 4, 0, 1),
                     torch.device("cpu"))
    assert alone.samples == size and 0 <= alone.accuracy <= 1
    for shared in ranks(2).run(_evaluate_on_ranks, size):
        assert shared.samples == size
        assert shared.accuracy == alone.accuracy
        assert shared.loss == pytest.approx(alone.loss, rel=1e-6)
