"""accelerate's own training loop on 2 CPU ranks, with torch's DDP and then with MiniDDP, in the same processes.

    python -m torch.distributed.run --nproc_per_node 2 tests/library/frameworks/accelerate_loop.py OUT_DIR

``Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")``: eight micro-batches under
``accelerator.accumulate(model)``, ``accelerator.clip_grad_norm_`` when the gradients are synchronized,
``save_state`` after the fourth; then a fresh model and optimizer ``load_state`` it and take the last four
again. MiniDDP swapped in with ``use_minddp()`` (``use_torch_ddp()`` before torch's run). Each rank saves
``OUT_DIR/rank{R}.pt``: by (torch|minddp), per micro-batch the loss, the parameters and the buffers, for the
first run and the resumed one, and the wrapper's class.
"""

import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

from both_ddps import save_and_leave, with_each_ddp  # (this script's folder is on sys.path)

torch.set_num_threads(1)


def batch(rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * i + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def train(micro_batches: range, checkpoint: str, resume: bool) -> tuple[list[dict], str]:
    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16", cpu=True)
    torch.manual_seed(accelerator.process_index)  # different on each rank: the first broadcast equalizes
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    if resume:
        accelerator.load_state(checkpoint)
    record = []
    for i in micro_batches:
        x, y = batch(accelerator.process_index, i)
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x).float(), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        record.append({"loss": loss.detach().clone(), "state": {
            name: t.detach().clone() for name, t in accelerator.unwrap_model(model).state_dict().items()}})
        if i == 3 and not resume:
            accelerator.save_state(checkpoint)
    return record, type(model).__name__


def main(out: str) -> None:
    def both_runs(which: str) -> dict:
        checkpoint = f"{out}/{which}-state"
        first, wrapper = train(range(8), checkpoint, resume=False)
        resumed, _ = train(range(4, 8), checkpoint, resume=True)
        return {"first": first, "resumed": resumed, "wrapper": wrapper}

    save_and_leave(with_each_ddp(both_runs), out)


if __name__ == "__main__":
    main(*sys.argv[1:])
