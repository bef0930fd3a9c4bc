"""Exact evaluation on the held-out split, shared over the ranks.

Exact means every held-out sample counted once, whatever the world size:
the loader's sampler is :class:`minddp.DistributedSampler` with ``pad=False,
drop_last=False`` (ranks may get one sample more than others, none
repeated), each rank sums its per-sample losses and correct answers, and one
all-reduce of ``(loss sum, correct, count)`` gives the totals. Averaging the
ranks' means instead would weigh a rank's samples by how few it has.

Every rank evaluates rank 0's model: BatchNorm running statistics are
buffers each rank updates from its own batches, so they are broadcast from
rank 0 first (the wrapper would do the same at the next forward, and the
checkpoint holds rank 0's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from minddp_lab.data import make_loader
from minddp_lab.models import model_loss

__all__ = ["Evaluation", "held_out_loader", "evaluate"]


@dataclass
class Evaluation:
    loss: float  # mean over the held-out samples
    accuracy: float | None  # fraction right, classifiers only
    samples: int


def held_out_loader(dataset: Dataset, global_batch_size: int, rank: int, world_size: int, workers: int = 0) -> DataLoader:
    """Every sample on exactly one rank, in a fixed order: no shuffling, no padding, no dropping."""
    return make_loader(
        dataset,
        global_batch_size,
        shuffle=False,
        drop_last=False,
        pad=False,
        num_workers=workers,
        rank=rank,
        world_size=world_size,
    )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    model_name: str,
    loader: DataLoader,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> Evaluation:
    """Mean loss (and accuracy for classifiers) of ``model`` on every sample of ``loader``'s dataset.

    ``model`` is the unwrapped model. Call it on every rank of the process
    group (it broadcasts and all-reduces), or without one.
    """
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if grouped:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
    was_training = model.training
    model.eval()
    # float64 sums: 10000 float32 losses added one by one would lose digits.
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    classifier = model_name != "ae"
    try:
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                output = model(images)
            # model_loss is a mean over the batch (per sample for ae, which averages
            # over pixels too); times the batch size it is the batch's sum.
            totals[0] += model_loss(model_name, output.float(), images, labels).double() * len(labels)
            if classifier:
                totals[1] += (output.argmax(dim=1) == labels).sum()
            totals[2] += len(labels)
    finally:
        model.train(was_training)
    if grouped:
        dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    if count == 0:
        return Evaluation(float("nan"), None, 0)
    return Evaluation(loss_sum / count, correct / count if classifier else None, int(count))
