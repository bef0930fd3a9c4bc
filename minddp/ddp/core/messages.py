"""What MiniDDP says when a step goes wrong: each message names the tensors at fault, the rank, the step and the fix.

Torch's DDP says some of these in general terms ("Expected to have finished
reduction in the prior iteration ...", a Gloo timeout with no word of DDP);
the reducer knows more at the moment it fails, and says it. Only words are
built here; the reducer and its parts decide when to raise or warn.
``docs/troubleshooting.md`` lists each next to torch's, with the command
(lesson 23) that makes it happen.
"""

from __future__ import annotations

import re

import torch.distributed as dist

__all__ = ["where", "missing_gradients", "bucket_never_arrived", "is_timeout", "nothing_unused", "gradient_twice"]


def where(reducer) -> tuple[int, int]:
    """(this rank in the reducer's group, the number of the synchronized backward now running)."""
    return dist.get_rank(reducer.process_group), reducer.backwards_done + 1


def missing_gradients(reducer, names: list[str]) -> str:
    """A synchronized backward ended while these parameters had no gradient (torch: at the next forward)."""
    rank, backward = where(reducer)
    return (
        f"MiniDDP: parameters {names} received no gradient on rank {rank} in synchronized backward #{backward}, "
        "so their buckets could not be all-reduced and no .grad was averaged. If a forward may leave some "
        "parameters unused (or some outputs out of the loss), construct MiniDDP(..., find_unused_parameters=True); "
        "if they are never used, leave them out of the model (or set requires_grad=False). "
        "(torch's DDP says: Expected to have finished reduction in the prior iteration before starting a new one.)"
    )


_TIMEOUT = re.compile(r"time[sd]? ?out", re.IGNORECASE)


def is_timeout(error: BaseException) -> bool:
    """Did a collective give up waiting (Gloo: "Timed out waiting ...ms"; NCCL's watchdog: "timeout")?"""
    return bool(_TIMEOUT.search(str(error)))


def bucket_never_arrived(reducer, bucket, error: BaseException) -> str:
    """This rank's all-reduce of ``bucket`` timed out: some rank never sent it."""
    (rank, backward), names, said = where(reducer), list(bucket.names), _first_line(error)
    return (
        f"MiniDDP: rank {rank} waited for bucket {bucket.index} ({names}) in synchronized backward "
        f"#{backward}, and not every one of the {reducer.world_size} ranks sent it before the process group's "
        "timeout. A rank that stopped sending it either ran out of data (uneven inputs: train inside "
        "`with model.join():`, or give every rank the same number of batches, e.g. "
        "DistributedSampler(drop_last=True)), or ran a different "
        "collective at this point (code on some ranks only: an evaluation, a barrier() or a print of a metric "
        "on rank 0, a data-dependent branch; run collectives on every rank, and TORCH_DISTRIBUTED_DEBUG=DETAIL "
        f"names both ranks' collectives). The process group said: {said}"
    )


def _first_line(error: BaseException) -> str:
    """The error's first line, without Gloo's source location (``[.../unbound_buffer.cc:78] ``)."""
    text = str(error).strip()
    return re.sub(r"^\[[^\]]*\.cc:\d+\] ", "", text.splitlines()[0]) if text else type(error).__name__


def nothing_unused(reducer) -> str:
    """``find_unused_parameters=True``, and the first synchronized forward used every parameter."""
    rank, _ = where(reducer)
    return (
        f"MiniDDP(find_unused_parameters=True) on rank {rank}: the first synchronized forward used every "
        "parameter, so the flag only cost a walk of the autograd graph (and one small all-reduce) per step. "
        "If no forward ever leaves a parameter unused, construct MiniDDP(..., find_unused_parameters=False). "
        "(A later forward that skips a layer would need it: then keep it.) "
        "(torch's DDP says: find_unused_parameters=True was specified in DDP constructor, but did not find any "
        "unused parameters in the forward pass.)"
    )


def gradient_twice(name: str) -> str:
    """A parameter's gradient hook fired a second time in one backward."""
    return (
        f"parameter {name!r} produced a gradient twice in one backward, and its bucket was already marked "
        "ready. Usually a block run twice under a reentrant activation checkpoint "
        "(torch.utils.checkpoint.checkpoint(..., use_reentrant=True)) with find_unused_parameters=True, or "
        "one parameter in two checkpointed blocks. Fix: checkpoint(..., use_reentrant=False), or construct "
        "MiniDDP(..., static_graph=True) when every step uses the same parameters; a second backward "
        "through the same graph needs one forward per backward. "
        "(torch's DDP says: Expected to mark a variable ready only once.)"
    )
