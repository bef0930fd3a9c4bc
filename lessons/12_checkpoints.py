"""Lesson 12: checkpoints -- save on one rank, load on all, resume exactly.

What you will learn
    After data-parallel training every rank holds the same weights, so one
    copy is enough, and p ranks writing one file at once would corrupt it.
    The recipe, every step of which this lesson runs:

    1. Rank 0 alone saves ``ddp.module.state_dict()`` (not ``ddp``'s, whose
       keys carry a ``module.`` prefix that a plain model will not load),
       the optimizer's state (Adam's moment estimates: without them a
       resumed run takes different steps) and the step number.
    2. It writes to a temporary file and ``os.replace``s it onto the final
       name: a rename is atomic, so a crash mid-write never leaves a
       half-written checkpoint under the real name.
    3. ``dist.barrier()``: nobody reads before rank 0 has finished writing.
    4. Every rank loads with ``map_location``. A tensor saved from ``cuda:0``
       loads back onto ``cuda:0`` by default -- on every rank, all onto one
       GPU. ``map_location`` puts it on this rank's device instead.
    5. Optimizer state built on one device and loaded on another must be
       moved to the parameters' device (``load_state_dict`` does this for
       tensors it recognizes; moving explicitly keeps it obvious and safe).
    6. Create directories with ``os.makedirs(..., exist_ok=True)``: several
       ranks racing to create the same folder otherwise crash at random.

    On this CPU-only run every device is ``cpu``; on GPUs, use
    ``map_location=f"cuda:{local_rank}"``. ``minddp.train.checkpoint`` packages the
    same recipe for the training script.

What to run
    python lessons/12_checkpoints.py [--world-size 4]

What to look at
    A run of 6 steps against a run that stops after 3, is rebuilt from the
    checkpoint in fresh objects, and does 3 more: the losses and final
    weights are identical.

Try this
    1. Predict the resumed losses if the checkpoint leaves out the optimizer
       state; the lesson runs it last. (The first resumed loss matches: it is
       computed before the first resumed step; every later one differs.)
    2. Save ``ddp.state_dict()`` instead of ``model.state_dict()`` and load
       it into the plain model: predict the error. (Unexpected and missing
       keys: every name carries ``module.``.)
    3. Remove the ``dist.barrier()`` in ``save_checkpoint`` and run a few
       times: predict what can happen. (Rank 1 may read before rank 0 has
       finished writing: file not found, or the previous checkpoint.)
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

from minddp import MiniDDP
from _common import parse_args, print0, print_ranks, run


def make_training(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = MiniDDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    return model, ddp, opt


def train_steps(ddp, opt, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + rank)  # the data of (step, rank)
        x, y = torch.randn(16, 20, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 6))
    return losses


def save_checkpoint(path: str, model: nn.Module, opt, step: int) -> None:
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
        os.replace(tmp, path)
    dist.barrier()


def optimizer_state_to(opt: torch.optim.Optimizer, device: torch.device) -> None:
    for state in opt.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":  # Adam keeps "step" on the CPU
                state[key] = value.to(device)


def main(rank: int, world_size: int, folder: str) -> None:
    path = os.path.join(folder, "checkpoints", "last.pt")
    device = torch.device("cpu")  # on GPUs: torch.device("cuda", local_rank)

    # Run A: six steps straight.
    _, ddp_a, opt_a = make_training()
    losses_a = train_steps(ddp_a, opt_a, range(6), rank)

    # Run B: three steps, a checkpoint, and then -- as if the job had been
    # killed -- everything rebuilt from scratch with a different seed.
    model_b, ddp_b, opt_b = make_training()
    losses_b = train_steps(ddp_b, opt_b, range(3), rank)
    save_checkpoint(path, model_b, opt_b, step=3)
    assert os.path.exists(path) and not os.path.exists(path + ".tmp")
    assert all(not k.startswith("module.") for k in model_b.state_dict())
    assert all(k.startswith("module.") for k in ddp_b.state_dict())

    model_c, ddp_c, opt_c = make_training(seed=123)
    checkpoint = torch.load(path, map_location=device)
    model_c.load_state_dict(checkpoint["model"])
    opt_c.load_state_dict(checkpoint["optimizer"])
    optimizer_state_to(opt_c, device)
    assert all(s["exp_avg"].device == device for s in opt_c.state.values())
    losses_b += train_steps(ddp_c, opt_c, range(checkpoint["step"], 6), rank)

    diff = max((a - c).abs().max().item() for a, c in zip(ddp_a.parameters(), ddp_c.parameters()))
    print0(f"rank 0 saved {path} (keys: {', '.join(checkpoint)}); every rank loaded it after the barrier")
    print0("losses per step, six straight steps vs 3 + checkpoint + 3:")
    print_ranks(f"straight {losses_a}\n           resumed  {losses_b}   max |weight diff| {diff:.1e}")
    assert losses_a == losses_b, "the resumed run takes exactly the same steps"
    assert diff == 0.0

    # What goes wrong without the optimizer state: Adam restarts its moments.
    model_d, ddp_d, opt_d = make_training(seed=123)
    model_d.load_state_dict(checkpoint["model"])
    losses_d = losses_b[:3] + train_steps(ddp_d, opt_d, range(3, 6), rank)
    assert losses_d[3] == losses_a[3] and losses_d[4:] != losses_a[4:]
    print0(f"resumed without the optimizer state: {losses_d[3:]} instead of {losses_a[3:]}")
    print0("checked: the file is in place with no temporary left; the saved keys have no")
    print0("         'module.' prefix; the optimizer state sits on the parameters' device; the")
    print0("         resumed run matches the straight run exactly; leaving out the optimizer")
    print0("         state changes the run.")


if __name__ == "__main__":
    args = parse_args(__doc__)
    # One folder for all ranks, made before they start and removed after.
    with tempfile.TemporaryDirectory() as folder:
        run(main, args.world_size, folder)
