"""Checkpoints that survive a crash: atomic save on rank 0, barrier, load onto each rank's device.

Saving. Only rank 0 writes (every rank holds the same parameters, so one copy
is enough). It writes to a temporary file *in the same directory*, flushes and
``fsync``s it, then ``os.replace``s it onto ``last.pt``. ``os.replace`` is
atomic on POSIX file systems: a reader sees the old file or the new one, never
half of one, so a job killed during a save leaves the previous ``last.pt``
whole. (The same directory matters: a rename across file systems is a copy,
and copies are not atomic.) Then *every* rank waits at a barrier, so no rank
runs ahead and, say, reads a checkpoint that is not there yet.

Loading. ``torch.load(map_location=device)`` puts every tensor straight onto
this rank's own device. Without it, tensors saved from ``cuda:0`` land on
``cuda:0`` in every process of a node (the classic "all ranks on GPU 0"
resume bug). The optimizer's state is then moved next to its parameters too,
so a resumed ``step()`` does not mix devices.

Everything a reader may get wrong raises :class:`CheckpointError` with one
readable sentence: no file, a file that is not a checkpoint (truncated,
corrupt, something else), a checkpoint of another model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Mapping

import torch
import torch.distributed as dist

__all__ = [
    "CheckpointError",
    "LAST",
    "FORMAT_VERSION",
    "save_checkpoint",
    "load_checkpoint",
    "move_optimizer_state",
]

LAST = "last.pt"
FORMAT_VERSION = 1
_TMP_PREFIX = ".minddp-tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or belongs to something else."""


def _fsync_dir(directory: str) -> None:
    # The rename itself lives in the directory entry; fsync it too so the new
    # name survives a power cut, not only the new bytes. Not every file
    # system lets a directory be opened for that; then there is nothing to do.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_torch_save(obj: Any, path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Whatever went wrong (disk full, KeyboardInterrupt), the old file is
        # untouched; only the half-written temporary goes.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def _remove_stale_temporaries(directory: str) -> None:
    # A process killed in the middle of a save leaves its temporary behind.
    # Only rank 0 saves, and it saves one file at a time, so any temporary
    # seen here is such an orphan.
    for name in os.listdir(directory):
        if name.startswith(_TMP_PREFIX):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def save_checkpoint(state: Mapping[str, Any], directory: str, *, keep_step_copy: bool = False) -> str | None:
    """Save ``state`` as ``directory/last.pt`` from rank 0, then barrier on every rank.

    Call it on *every* rank (the barrier is collective). With
    ``keep_step_copy`` rank 0 also keeps ``step-<N>.pt`` (``N`` from
    ``state["step"]``), written atomically in the same way. Returns the path
    written on rank 0, ``None`` elsewhere. Works without a process group too
    (one process: it is rank 0, and there is no barrier).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = None
    if rank == 0:
        # Only rank 0 creates the directory: N ranks racing on mkdir is a
        # classic source of "File exists" crashes on shared file systems.
        os.makedirs(directory, exist_ok=True)
        _remove_stale_temporaries(directory)
        path = os.path.join(directory, LAST)
        payload = dict(state)
        payload["format_version"] = FORMAT_VERSION
        _atomic_torch_save(payload, path)
        if keep_step_copy:
            step_path = os.path.join(directory, f"step-{int(state['step'])}.pt")
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".pt", dir=directory)
            os.close(fd)
            shutil.copyfile(path, tmp)
            os.replace(tmp, step_path)
    if dist.is_initialized():
        dist.barrier()
    return path


def load_checkpoint(
    path: str,
    device: torch.device | str = "cpu",
    *,
    expect: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Read a checkpoint with every tensor mapped onto ``device``.

    ``expect`` maps top-level keys to the values they must have (for example
    ``{"model_name": "cnn"}``); a mismatch raises :class:`CheckpointError`
    saying what the checkpoint holds instead. ``weights_only=True``: a
    checkpoint holds tensors and plain Python values only, so loading one
    never runs code from the file.
    """
    if os.path.isdir(path):
        path = os.path.join(path, LAST)
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # truncated zip, random bytes, a pickle of something else...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path} is not a readable checkpoint (corrupt or truncated?): {reason}") from None
    if not isinstance(state, dict) or "format_version" not in state:
        raise CheckpointError(f"{path} is not a minddp checkpoint (no format_version entry)")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {state['format_version']}, this minddp reads format {FORMAT_VERSION}"
        )
    for key, want in (expect or {}).items():
        have = state.get(key)
        if have != want:
            raise CheckpointError(f"{path} was written for {key} {have!r}, not {want!r}")
    return state


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every tensor of the optimizer's state (momentum, Adam moments) onto ``device``.

    ``Optimizer.load_state_dict`` already casts state onto its parameter's
    device, but only for state that matches a parameter; being explicit costs
    nothing and also covers optimizers that keep extra tensors. Adam's
    ``step`` counter stays where it is: torch keeps it on the CPU on purpose
    (unless ``capturable``/``fused``), exactly as ``load_state_dict`` does.
    """
    for per_param in optimizer.state.values():
        for key, value in per_param.items():
            if key == "step":
                continue
            if torch.is_tensor(value) and value.device != torch.device(device):
                per_param[key] = value.to(device)
