"""For the run scripts launched with ``torch.distributed.run``: run a training with torch's DDP and then with
MiniDDP swapped in, in this process, and save each rank's record."""

from typing import Callable

import torch

from minddp.frameworks.accelerate import use_minddp, use_torch_ddp


def with_each_ddp(train: Callable[[str], dict]) -> dict[str, dict]:
    """``train(which)`` after ``use_torch_ddp()`` (``"torch"``), then after ``use_minddp()`` (``"minddp"``),
    as a user's script calls it; torch's class in place again at the end."""
    results = {}
    for which, swap in (("torch", use_torch_ddp), ("minddp", use_minddp)):
        swap()
        results[which] = train(which)
    use_torch_ddp()
    return results


def save_and_leave(results: dict, out: str) -> None:
    """This rank's results to ``OUT/rank{R}.pt``, then the process group left before the interpreter exits."""
    torch.save(results, f"{out}/rank{torch.distributed.get_rank()}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
