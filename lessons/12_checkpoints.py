"""Lesson 12: checkpoints -- save on one rank, load on all, resume exactly.

What you will learn
    After data-parallel training every rank holds the same weights, so one
    copy is enough, and p ranks writing one file at once would corrupt it.
    The recipe, every step of which this lesson runs:

    1. Rank 0 alone saves ``ddp.module.state_dict()`` (not ``ddp``'s, whose
       keys carry a ``module.`` prefix that a plain model will not load).
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

    The weights are not all a run is made of. For the resumed run to take
    *exactly* the steps the uninterrupted one would have taken, the
    checkpoint also holds

    * the optimizer's state (Adam's moment estimates),
    * the learning-rate scheduler's state (where in its schedule it is),
    * the GradScaler's state (its current scale, lesson 13),
    * every rank's random number generator state (dropout draws from it;
      each rank's is different, so rank 0 gathers them all),
    * where the data stopped: the epoch, for ``DistributedSampler.set_epoch``,
      and how many of that epoch's batches were already used, to skip.

    The lesson leaves each one out in turn and shows the run change. What
    it still assumes: the same world size (the per-rank RNG states and the
    sampler's shards are per rank) and the same versions and machine
    (bit-exact floating point). DataLoader workers (``num_workers > 0``) have
    RNG states of their own, not saved here, and the loader gets a generator
    of its own (see ``Training``): iterating a DataLoader draws from the
    global RNG otherwise. ``minddp_lab.train.checkpoint``
    packages the same recipe for the training script.

    On this CPU-only run every device is ``cpu``; on GPUs, use
    ``map_location=f"cuda:{local_rank}"``, and save
    ``torch.cuda.get_rng_state()`` too.

What to run
    python lessons/12_checkpoints.py [--world-size 4] [--save-ddp-state-dict] [--no-barrier]

What to look at
    A run of 9 steps against a run that stops after 5 (in the middle of its
    second epoch), is rebuilt from the checkpoint in fresh objects, and does
    4 more: the losses and final weights are identical. Then the same resume
    with one piece of the state left out at a time.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Predict which losses change when the resumed run leaves out the
       optimizer state, the scheduler's, the RNG states or the data
       position (the lesson runs each).
    2. ``--save-ddp-state-dict``: save ``ddp.state_dict()`` instead of
       ``model.state_dict()`` and load it into the plain model: predict the
       error.
    3. ``--no-barrier``: ``save_checkpoint`` without ``dist.barrier()``,
       and rank 0's write made slow -- so slow that it finishes only after
       the others have looked, the unlucky order a busy disk makes likely
       (the lesson makes it certain, so the outcome does not depend on the
       load). Predict what the other ranks read.
"""

import os
import tempfile
from itertools import islice

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from minddp import DistributedSampler, MiniDDP
from _common import parse_args, print0, print_ranks, run

PER_RANK_BATCH = 8
SAMPLES = 24  # per rank: 3 batches per epoch, whatever the world size
STEPS, SAVE_AT = 9, 5  # three epochs; the checkpoint in the middle of the second


class Training:
    """Everything a run is made of: model, wrapper, optimizer, scheduler, scaler, data."""

    def __init__(self, rank: int, world_size: int, seed: int = 0):
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 4))
        self.ddp = MiniDDP(self.model)
        self.opt = torch.optim.Adam(self.ddp.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        # A scaler as mixed precision uses it (lesson 13); it doubles its scale every clean step.
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
        gen = torch.Generator().manual_seed(0)  # the same dataset on every rank
        n = SAMPLES * world_size
        data = TensorDataset(torch.randn(n, 20, generator=gen), torch.randint(0, 4, (n,), generator=gen))
        self.sampler = DistributedSampler(data, shuffle=True, seed=0)
        # Its own generator: every new iteration of a DataLoader draws a seed
        # for its workers, from the global RNG unless given one -- and a
        # resumed run starts its epoch's iteration at another step than the
        # straight run, which would shift every dropout mask after it.
        self.loader = DataLoader(data, batch_size=PER_RANK_BATCH, sampler=self.sampler, generator=torch.Generator())
        torch.manual_seed(1000 + seed + rank)  # dropout: other masks on every rank

    def train(self, steps: range) -> list[float]:
        losses, per_epoch = [], len(self.loader)
        step = steps.start
        while step < steps.stop:
            epoch, done = divmod(step, per_epoch)
            self.sampler.set_epoch(epoch)
            for x, y in islice(self.loader, done, done + steps.stop - step):  # skip the batches already used
                self.opt.zero_grad()
                loss = nn.functional.cross_entropy(self.ddp(x), y)
                self.scaler.scale(loss).backward()
                self.scaler.step(self.opt)
                self.scaler.update()
                self.scheduler.step()
                losses.append(loss.item())
                step += 1
        return losses

    def state(self, step: int, ddp_keys: bool = False) -> dict:
        """What goes into the checkpoint; a collective (it gathers every rank's RNG state)."""
        rng = [None] * dist.get_world_size()
        dist.all_gather_object(rng, torch.get_rng_state())
        return {
            "model": (self.ddp if ddp_keys else self.model).state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng,
            "step": step,  # with len(loader): the epoch and the batches already used in it
        }

    def restore(self, checkpoint: dict, rank: int, device: torch.device, leave_out: str = "") -> int:
        """Load the checkpoint; ``leave_out`` names one piece to skip. Returns the step to go on from."""
        self.model.load_state_dict(checkpoint["model"])
        if leave_out != "optimizer":
            self.opt.load_state_dict(checkpoint["optimizer"])
            optimizer_state_to(self.opt, device)
        if leave_out != "scheduler":
            self.scheduler.load_state_dict(checkpoint["scheduler"])
        if leave_out != "scaler":
            self.scaler.load_state_dict(checkpoint["scaler"])
        if leave_out != "rng":
            torch.set_rng_state(checkpoint["rng"][rank])
        # Leaving out the data position: the loop starts its epochs over from 0.
        return 0 if leave_out == "data position" else checkpoint["step"]


def save_checkpoint(path: str, state: dict, barrier: bool = True, before_rename=None) -> None:
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp"
        torch.save(state, tmp)
        if before_rename is not None:  # --no-barrier: the write is still going on
            before_rename()
        os.replace(tmp, path)
    if barrier:
        dist.barrier()


def optimizer_state_to(opt: torch.optim.Optimizer, device: torch.device) -> None:
    for state in opt.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":  # Adam keeps "step" on the CPU
                state[key] = value.to(device)


def rounded(losses: list[float]) -> list[float]:
    return [round(v, 4) for v in losses]


def save_ddp_state_dict(rank: int, world_size: int, path: str) -> None:
    """Exercise 2: the wrapper's state dict, loaded into the plain model."""
    training = Training(rank, world_size)
    save_checkpoint(path, training.state(0, ddp_keys=True))
    try:
        Training(rank, world_size, seed=123).model.load_state_dict(torch.load(path)["model"])
        outcome = "loaded"
    except RuntimeError as error:
        outcome = str(error)
    print0(f"--save-ddp-state-dict: loading ddp.state_dict() into the plain model:\n  {outcome[:400]}")
    assert "Missing key(s)" in outcome and "Unexpected key(s)" in outcome and '"module.0.weight"' in outcome, (
        f"expected missing and unexpected keys, the latter with the 'module.' prefix; saw: {outcome}")
    print0("checked: every key carries 'module.': the plain model finds none of its own.")


def no_barrier(rank: int, world_size: int, path: str) -> None:
    """Exercise 3: rank 0 writes slowly, nobody waits for it."""
    # The slow write, made certain: rank 0 renames its file into place only
    # once every other rank has looked for it (one barrier on each side).
    save_checkpoint(path, Training(rank, world_size).state(0), barrier=False, before_rename=dist.barrier)
    outcome = "the file is there" if os.path.exists(path) else "found no file"
    if rank != 0:
        dist.barrier()  # "I have looked": lets rank 0 finish its write
    everyone = [None] * world_size
    dist.all_gather_object(everyone, outcome)
    print_ranks(f"right after save_checkpoint without the barrier: {outcome}")
    assert everyone[0] == "the file is there" and all(o == "found no file" for o in everyone[1:]), (
        f"expected rank 0 to see its file and every other rank none, saw {everyone}")
    print0("checked: without the barrier the other ranks looked before rank 0 had finished writing.")


def main(rank: int, world_size: int, folder: str, exercise: str = "") -> None:
    path = os.path.join(folder, "checkpoints", "last.pt")
    device = torch.device("cpu")  # on GPUs: torch.device("cuda", local_rank)
    if exercise == "save-ddp-state-dict":
        return save_ddp_state_dict(rank, world_size, path)
    if exercise == "no-barrier":
        return no_barrier(rank, world_size, path)

    # Run A: all the steps straight.
    run_a = Training(rank, world_size)
    straight = run_a.train(range(STEPS))

    # Run B: some steps, a checkpoint, and then -- as if the job had been
    # killed -- everything rebuilt from scratch with a different seed.
    run_b = Training(rank, world_size)
    resumed = run_b.train(range(SAVE_AT))
    save_checkpoint(path, run_b.state(SAVE_AT))
    assert os.path.exists(path) and not os.path.exists(path + ".tmp")
    assert all(not k.startswith("module.") for k in run_b.model.state_dict())
    assert all(k.startswith("module.") for k in run_b.ddp.state_dict())

    checkpoint = torch.load(path, map_location=device)
    run_c = Training(rank, world_size, seed=123)
    start = run_c.restore(checkpoint, rank, device)
    assert all(s["exp_avg"].device == device for s in run_c.opt.state.values())
    resumed += run_c.train(range(start, STEPS))

    diff = max((a - c).abs().max().item() for a, c in zip(run_a.model.parameters(), run_c.model.parameters()))
    print0(f"rank 0 saved {path} (keys: {', '.join(checkpoint)}); every rank loaded it after the barrier")
    print0(f"losses per step, {STEPS} straight steps vs {SAVE_AT} + checkpoint + {STEPS - SAVE_AT} (3 batches per epoch):")
    print_ranks(f"straight {rounded(straight)}\n           resumed  {rounded(resumed)}   max |weight diff| {diff:.1e}")
    assert resumed == straight, f"the resumed run takes exactly the same steps: expected {straight}, saw {resumed}"
    assert diff == 0.0, f"expected identical final weights, saw a difference of {diff:.1e}"

    # Each piece left out in turn: what the resumed run then does.
    print0(f"\nresumed with one piece left out, losses of steps {SAVE_AT}..{STEPS - 1} (straight: {rounded(straight[SAVE_AT:])}):")
    # Read the file anew for every resume: the optimizer's load_state_dict
    # keeps the loaded tensors themselves (no copy), so the run before has
    # trained the moments of the ``checkpoint`` dict in memory further.
    expected_first = {"optimizer": True, "scheduler": True, "rng": False, "data position": False}
    for piece, first_matches in expected_first.items():
        partial = Training(rank, world_size, seed=123)
        start = partial.restore(torch.load(path, map_location=device), rank, device, leave_out=piece)
        losses = partial.train(range(start, STEPS))[-(STEPS - SAVE_AT):]
        print0(f"  without the {piece:<13} {rounded(losses)}")
        seen_first = losses[0] == straight[SAVE_AT]
        assert seen_first == first_matches, (
            f"without the {piece}: expected the first resumed loss to {'match' if first_matches else 'differ'}, "
            f"saw {losses[0]} against {straight[SAVE_AT]}")
        assert losses[1:] != straight[SAVE_AT + 1:], f"without the {piece}: expected the later losses to differ, saw the same"
    partial = Training(rank, world_size, seed=123)
    partial.restore(torch.load(path, map_location=device), rank, device, leave_out="scaler")
    fresh_scale, saved_scale = partial.scaler.get_scale(), checkpoint["scaler"]["scale"]
    losses = partial.train(range(SAVE_AT, STEPS))
    print0(f"  without the scaler        {rounded(losses)}: the same in float32, but its scale restarts at "
           f"{fresh_scale:g} instead of {saved_scale:g}")
    assert losses == straight[SAVE_AT:] and fresh_scale != saved_scale, (
        f"expected the same losses and another scale, saw {losses} and scale {fresh_scale} (saved {saved_scale})")

    print0("checked: the file is in place with no temporary left; the saved keys have no")
    print0("         'module.' prefix; the optimizer state sits on the parameters' device; the")
    print0("         resumed run matches the straight run bit for bit; leaving out the optimizer,")
    print0("         scheduler, RNG or data position changes the run, the scaler its scale.")


if __name__ == "__main__":
    def options(parser):
        parser.add_argument("--save-ddp-state-dict", action="store_true", help="exercise 2")
        parser.add_argument("--no-barrier", action="store_true", help="exercise 3")
    args = parse_args(__doc__, extra=options)
    exercise = "save-ddp-state-dict" if args.save_ddp_state_dict else "no-barrier" if args.no_barrier else ""
    # One folder for all ranks, made before they start and removed after.
    with tempfile.TemporaryDirectory() as folder:
        run(main, args.world_size, folder, exercise)
