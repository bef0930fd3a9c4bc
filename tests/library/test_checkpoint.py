"""Checkpoints: atomic, barrier-guarded, mapped onto the loading rank's device, with readable errors."""

import os

import pytest
import torch
import torch.distributed as dist

from minddp_lab.train import checkpoint as ckpt
from minddp_lab.train.checkpoint import CheckpointError, load_checkpoint, move_optimizer_state, save_checkpoint


def _state(step=3, name="ae"):
    model = torch.nn.Linear(4, 2)
    return {"model": model.state_dict(), "step": step, "model_name": name}


def test_save_then_load_round_trips(tmp_path):
    state = _state()
    path = save_checkpoint(state, str(tmp_path / "run"))
    assert path == str(tmp_path / "run" / "last.pt")
    back = load_checkpoint(path, "cpu", expect={"model_name": "ae"})
    assert back["step"] == 3
    assert torch.equal(back["model"]["weight"], state["model"]["weight"])
    assert load_checkpoint(str(tmp_path / "run"))["step"] == 3  # a directory means DIR/last.pt
    assert os.listdir(tmp_path / "run") == ["last.pt"]  # no temporary left behind


def test_keep_step_copy(tmp_path):
    save_checkpoint(_state(step=4), str(tmp_path), keep_step_copy=True)
    save_checkpoint(_state(step=8), str(tmp_path), keep_step_copy=True)
    assert sorted(os.listdir(tmp_path)) == ["last.pt", "step-4.pt", "step-8.pt"]
    assert load_checkpoint(str(tmp_path / "step-4.pt"))["step"] == 4
    assert load_checkpoint(str(tmp_path))["step"] == 8


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(_state(step=1), str(tmp_path))
    real_save = torch.save

    def dies_half_way(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip file")  # some bytes reach the disk, then the crash
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(_state(step=2), str(tmp_path))
    monkeypatch.setattr(torch, "save", real_save)
    assert load_checkpoint(str(tmp_path))["step"] == 1
    assert os.listdir(tmp_path) == ["last.pt"]


def test_orphaned_temporary_is_removed_by_the_next_save(tmp_path):
    # What a SIGKILL during torch.save leaves: a temporary beside last.pt.
    orphan = tmp_path / f"{ckpt._TMP_PREFIX}abc.pt"
    orphan.write_bytes(b"half")
    save_checkpoint(_state(), str(tmp_path))
    assert os.listdir(tmp_path) == ["last.pt"]


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at .*last.pt"):
        load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all\n" * 10], ids=["empty", "garbage"])
def test_corrupt_checkpoint(tmp_path, content):
    (tmp_path / "last.pt").write_bytes(content)
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(str(tmp_path))


def test_truncated_checkpoint(tmp_path):
    save_checkpoint(_state(), str(tmp_path))
    data = (tmp_path / "last.pt").read_bytes()
    (tmp_path / "last.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(str(tmp_path))


def test_a_plain_state_dict_is_not_a_minddp_checkpoint(tmp_path):
    torch.save(torch.nn.Linear(2, 2).state_dict(), tmp_path / "last.pt")
    with pytest.raises(CheckpointError, match="not a minddp checkpoint"):
        load_checkpoint(str(tmp_path))


def test_checkpoint_of_another_model(tmp_path):
    save_checkpoint(_state(name="ae"), str(tmp_path))
    with pytest.raises(CheckpointError, match="written for model_name 'ae', not 'cnn'"):
        load_checkpoint(str(tmp_path), expect={"model_name": "cnn"})


def test_map_location_and_optimizer_state_move(tmp_path):
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict()}, str(tmp_path))
    # "meta" stands in for "this rank's GPU": every tensor must land on the device asked for.
    state = load_checkpoint(str(tmp_path), torch.device("meta"))
    assert all(t.device.type == "meta" for t in state["model"].values())
    move_optimizer_state(opt, "meta")
    for per_param in opt.state.values():
        assert per_param["exp_avg"].device.type == "meta"
        assert per_param["step"].device.type == "cpu"  # torch keeps Adam's step counter on the CPU


def _rank0_saves_rank1_reads(rank, world_size, directory):
    # Rank 1 reads right after the barrier: the file must be complete by then.
    save_checkpoint({"step": 7, "written_by": dist.get_rank()}, directory)
    return load_checkpoint(directory)["written_by"], sorted(os.listdir(directory))


def test_only_rank0_writes_and_everyone_waits(ranks, tmp_path):
    results = ranks(2).run(_rank0_saves_rank1_reads, str(tmp_path / "shared"), timeout_s=60)
    assert results == [(0, ["last.pt"]), (0, ["last.pt"])]
