"""``minddp-train --zero 1|2``: the same training as ``--zero 0``, with the optimizer state (and gradients) sharded.

The runs are the trainer's own ``train()`` on the live rank pool (a
subprocess per run would spend most of its time importing torch): tiny
synthetic data, a few steps, accumulation and clipping on.

Tolerance of the stage-versus-plain comparisons. Without clipping, on two
ranks, the stages equal ``--zero 0`` bit for bit (tested): the momentum and
the SGD update are the same element-wise operations on a flat shard as on
the tensors, each gradient is multiplied by 1/2 before the sum in both, and a
sum of two floats does not depend on its order (an all-reduce in DDP, a
reduce-scatter in stage 2). With clipping on, the only arithmetic that
differs is the clipping norm: torch's
``clip_grad_norm_`` takes one norm per tensor and then the norm of those,
ZeRO sums the squares of each rank's shard and all-reduces the partial sums.
Same terms, another order of float32 additions: the coefficient differs by
a few units in the last place (float32's eps is 1.2e-7), and so does each
clipped update. After a few steps of updates of size
``lr * clip`` that leaves the parameters equal to ~1e-9 (measured: at most
1.9e-9 after 4 steps on 2 ranks, 2.3e-10 for the 3-rank resume);
``rtol=1e-6, atol=1e-7`` is a few float32 ulps of a parameter of size ~1, a
thousand times below what a missing clip, a lost momentum or a shard
stepped twice would change (~1e-4 and more). The small clipped steps matter:
unclipped, this cnn (BatchNorm on 16 samples) amplifies a rounding-sized
difference (an lr 1e-7 larger: 6e-8 after 3 steps, 1.3e-5 after 4), so an
unclipped comparison is either exact or not a test.
"""

import contextlib
import io
import shutil

import pytest
import torch

from minddp_lab.train import main
from minddp_lab.train.checkpoint import load_checkpoint
from minddp_lab.train.cli import UsageError, build_parser, check_args

# 256 samples, global batch 32, 2 micro-batches per step -> 4 steps per epoch.
SMALL = ["--synthetic-size", "256", "--batch-size", "32", "--grad-accum", "2", "--log-every", "2", "--timeout-s", "20"]
CLIPPED = ["--clip-grad", "0.01"]  # far below the cnn's gradient norm: every step is clipped
TOLERANCE = {"rtol": 1e-6, "atol": 1e-7}  # see the module's docstring


def _train_here(rank, world_size, argv):
    """Rank ``rank`` runs the trainer's ``train()``; returns rank 0's log and what the optimizer held at the end."""
    from minddp_lab.train import loop
    from minddp_lab.train.fully_sharded import FullyShardedSGD
    from minddp.zero import ZeroRedundancyOptimizer

    args = build_parser().parse_args(argv)
    check_args(args, world_size)
    built, real_build = [], loop.build_optimizer

    def build_and_keep(*a, **kw):  # a spy: the optimizer the trainer built, to look into afterwards
        built.append(real_build(*a, **kw))
        return built[-1]

    loop.build_optimizer = build_and_keep
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            loop.train(args, rank, world_size, rank)
    finally:
        loop.build_optimizer = real_build
    (optimizer,) = built
    if isinstance(optimizer, FullyShardedSGD):
        # What this rank keeps: each momentum is a DTensor like its parameter; its local rows are this rank's.
        held = ("fsdp", 3, sum(st["momentum_buffer"].to_local().numel() for st in optimizer.state.values()))
    elif isinstance(optimizer, ZeroRedundancyOptimizer):
        kept = sum(v.numel() for st in optimizer.optim.state.values() for v in st.values() if torch.is_tensor(v))
        held = ("zero", 2 if optimizer.shard_gradients else 1, kept)
    else:
        held = ("plain", 0, sum(st["momentum_buffer"].numel() for st in optimizer.state.values()))
    return out.getvalue(), held


def _run(pool, directory, *argv):
    return pool.run(_train_here, [*SMALL, "--checkpoint-dir", str(directory), *argv], timeout_s=90)


def _assert_same_parameters(a, b, **exact_or_tolerance):
    for name in a["model"]:
        torch.testing.assert_close(a["model"][name], b["model"][name], msg=lambda m, n=name: f"{n}: {m}",
                                   **exact_or_tolerance)
    for index, state in a["optimizer"]["state"].items():  # the momentum, consolidated into last.pt
        torch.testing.assert_close(state["momentum_buffer"], b["optimizer"]["state"][index]["momentum_buffer"],
                                   msg=lambda m, i=index: f"momentum of parameter {i}: {m}", **exact_or_tolerance)


def test_zero_stages_train_like_plain_sgd_with_accumulation_and_clipping(ranks, tmp_path):
    pool = ranks(2)
    plain = _run(pool, tmp_path / "z0", "--max-steps", "4", *CLIPPED, "--zero", "0")
    numel = plain[0][1][2]
    assert [held for _, held in plain] == [("plain", 0, numel)] * 2  # every rank keeps all of the momentum
    assert "ZeRO" not in plain[0][0]
    # Stage 1 also on torch's DDP (the optimizer then reads the averaged .grad at its step).
    for stage, ddp in ((1, "mini"), (2, "mini"), (1, "torch")):
        runs = _run(pool, tmp_path / f"z{stage}{ddp}", "--max-steps", "4", *CLIPPED, "--zero", str(stage), "--ddp", ddp)
        what = "optimizer state" if stage == 1 else "optimizer state and gradients"
        assert f"({ddp}, gloo)" in runs[0][0] and f"ZeRO stage {stage} ({what} sharded over 2 ranks)" in runs[0][0]
        # Each rank keeps half of the momentum: the flat partition cuts the cnn's
        # 29,178 elements into two equal pieces (no padding: the count is even).
        kept = [held[2] for _, held in runs]
        assert [held[:2] for _, held in runs] == [("zero", stage)] * 2
        assert numel % 2 == 0 and kept == [numel // 2] * 2, (kept, numel)
        _assert_same_parameters(load_checkpoint(str(tmp_path / "z0")),
                                load_checkpoint(str(tmp_path / f"z{stage}{ddp}")), **TOLERANCE)


def test_without_clipping_two_ranks_of_stage_2_equal_plain_sgd_bit_for_bit(ranks, tmp_path):
    _run(ranks(2), tmp_path / "z0", "--max-steps", "4", "--zero", "0")
    _run(ranks(2), tmp_path / "z2", "--max-steps", "4", "--zero", "2")
    _assert_same_parameters(load_checkpoint(str(tmp_path / "z0")), load_checkpoint(str(tmp_path / "z2")), rtol=0, atol=0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_resume_equals_an_uninterrupted_run(ranks, tmp_path, stage):
    # Stopped at step 3 of 6: mid-epoch, mid-momentum; same ranks, same arithmetic: bit for bit.
    pool, common = ranks(2), ["--epochs", "2", "--max-steps", "6", *CLIPPED, "--zero", str(stage)]
    _run(pool, tmp_path / "once", *common)
    _run(pool, tmp_path / "twice", *common, "--max-steps", "3")
    (log, held), _ = _run(pool, tmp_path / "twice", *common, "--resume")
    assert held[:2] == ({0: "plain", 3: "fsdp"}.get(stage, "zero"), stage)
    assert "resumed from" in log and "at step 3" in log and "warning" not in log, log
    once, twice = load_checkpoint(str(tmp_path / "once")), load_checkpoint(str(tmp_path / "twice"))
    assert once["step"] == twice["step"] == 6
    _assert_same_parameters(once, twice, rtol=0, atol=0)


@pytest.mark.parametrize("stage", ["2", "3"])
def test_zero_checkpoint_resumes_on_three_ranks_and_without_zero(ranks, tmp_path, stage):
    # Saved by 2 ranks under stage 2 (gradients and momentum sharded) or 3
    # (the parameters too; last.pt holds whole weights and whole momentum);
    # each of 3 ranks then takes the part it owns now. Resumed with the same
    # --zero and, from the same file, with --zero 0 (the consolidated state
    # is torch's SGD format): the two continuations agree.
    common = ["--batch-size", "24", "--epochs", "2", "--max-steps", "6", *CLIPPED]
    _run(ranks(2), tmp_path / "sharded", *common, "--max-steps", "3", "--zero", stage)
    shutil.copytree(tmp_path / "sharded", tmp_path / "whole")
    at_three = load_checkpoint(str(tmp_path / "whole"))
    for name, resumed_stage in (("sharded", stage), ("whole", "0")):
        (log, _), *_ = _run(ranks(3), tmp_path / name, *common, "--resume", "--zero", resumed_stage)
        assert "at step 3" in log and "written by 2 ranks, resuming on 3" in log, log
    sharded, whole = load_checkpoint(str(tmp_path / "sharded")), load_checkpoint(str(tmp_path / "whole"))
    assert sharded["step"] == whole["step"] == 6 and sharded["world_size"] == 3
    _assert_same_parameters(sharded, whole, **TOLERANCE)
    # ...and they trained on from step 3 (more than the tolerance away from it).
    assert any((sharded["model"][n] - at_three["model"][n]).abs().max() > 1e-4 for n in at_three["model"])


def test_stage_3_trains_like_plain_sgd_with_accumulation_and_clipping(ranks, tmp_path):
    # Parameters, gradients and momentum sharded (minddp.fsdp on each layer of the cnn, then the model);
    # the same steps as --zero 0: accumulation through set_requires_gradient_sync, the global clipping norm.
    pool = ranks(2)
    plain = _run(pool, tmp_path / "z0", "--max-steps", "4", *CLIPPED, "--zero", "0")
    runs = _run(pool, tmp_path / "z3", "--max-steps", "4", *CLIPPED, "--zero", "3")
    assert "ZeRO stage 3 (parameters, gradients and optimizer state sharded over 2 ranks)" in runs[0][0], runs[0][0]
    assert "validation loss" in runs[0][0]  # evaluated on a whole copy: ranks with unequal batches do not hang
    numel = plain[0][1][2]
    kept = [held[2] for _, held in runs]
    assert [held[:2] for _, held in runs] == [("fsdp", 3)] * 2 and sum(kept) == numel and max(kept) < numel, kept
    z0, z3 = load_checkpoint(str(tmp_path / "z0")), load_checkpoint(str(tmp_path / "z3"))
    assert set(z3["model"]) == set(z0["model"])  # whole parameters and buffers, by the plain model's names
    _assert_same_parameters(z0, z3, **TOLERANCE)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--zero", "2", "--ddp", "torch"], "--zero 2 shards the gradients .* --ddp torch has no such hook"),
        (["--zero", "1", "--amp", "--backend", "nccl"], "--zero 1 with --amp on CUDA .* is not supported"),
        (["--zero", "3", "--ddp", "torch"], "--zero 3 replaces the DDP wrapper .* --ddp torch would not be used"),
        (["--zero", "3", "--sync-bn"], "--zero 3 with --sync-bn is not supported"),
    ],
    ids=["stage2-on-torch-ddp", "zero-with-float16-loss-scaling", "stage3-with-torch-ddp", "stage3-with-sync-bn"],
)
def test_combinations_zero_cannot_run_get_one_clear_line(capsys, monkeypatch, argv, message):
    import re

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match=message):
        check_args(build_parser().parse_args(argv), 2)
    code = main(["--max-steps", "1", *argv])  # through the program: exit 2, one line, before any rank starts
    err = capsys.readouterr().err
    assert code == 2 and re.fullmatch(f"minddp-train: error: .*{message}.*\n", err), err
    with pytest.raises(SystemExit):  # an unknown stage: argparse names the flag
        build_parser().parse_args(["--zero", "4"])
    assert "argument --zero: invalid choice: 4" in capsys.readouterr().err


def _weights_loaded_after_the_optimizer_was_built(rank, world_size, stage):
    from minddp.ddp.wrapper import MiniDDP
    from minddp.zero import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    ddp_model = MiniDDP(model)
    opt = ZeroRedundancyOptimizer(ddp_model.parameters(), torch.optim.SGD, ddp=ddp_model,
                                  shard_gradients=stage == 2, lr=0.1, momentum=0.9)
    loaded = {k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()}
    for lr in (0.1, 0.0):  # a real step first (stage 2 fixes its partition there), then a step that changes nothing
        ddp_model(torch.rand(4, 5)).sum().backward()
        if lr == 0.0:
            model.load_state_dict(loaded)  # what a resume does, after the optimizer exists
            opt.param_groups[0]["lr"] = 0.0
        opt.step()
    return {k: torch.equal(v, loaded[k]) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_steps_the_weights_loaded_after_it_was_built(ranks, stage):
    # The usual resume order (build model and optimizer, then load both) must
    # not step a copy of the weights taken before the load.
    for kept in ranks(2).run(_weights_loaded_after_the_optimizer_was_built, stage):
        assert all(kept.values()), kept
