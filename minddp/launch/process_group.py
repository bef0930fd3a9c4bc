"""Join the job's process group, and leave it together.

:func:`init_distributed` reads where this process sits (:mod:`minddp.launch.environment`)
and starts the default group; :func:`distributed` is the context manager a
training script wraps itself in; it always destroys the group, also when the
body raises, so a crashed rank does not leave sockets and threads behind.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from minddp.launch.environment import DEFAULT_PORT, LaunchInfo, default_backend, detect_launch

__all__ = ["init_distributed", "shutdown", "distributed"]


def init_distributed(
    backend: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
) -> LaunchInfo:
    """Initialise the default process group and return where we are in it.

    With ``rank`` and ``world_size`` given (``mp.spawn``), the master is
    ``MASTER_ADDR``/``MASTER_PORT`` from the environment or
    ``localhost:29500``. Otherwise the launcher is read by
    :func:`detect_launch`. The backend defaults to :func:`default_backend`.
    Where CUDA is visible, the current device is set to the local rank
    (modulo the GPUs) *before* the group starts, for Gloo as for NCCL: NCCL
    binds each rank to its own GPU, and ``"cuda"`` then means this rank's GPU
    (with more ranks than GPUs, under Gloo, ranks share them).

    A dead peer: under ``minddp-train --nproc`` and torchrun the supervisor
    stops the survivors within seconds. Launched otherwise (srun, mpirun),
    NCCL's survivors notice at ``timeout_s``, when the watchdog
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, set here unless already set) tears
    them down instead of leaving them hung; Gloo's at their next collective.
    """
    env = os.environ if env is None else env
    if (rank is None) != (world_size is None):
        raise ValueError(f"pass rank and world_size together, got rank={rank}, world_size={world_size}")
    if rank is not None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        info = LaunchInfo(
            rank=rank,
            world_size=world_size,
            local_rank=int(env.get("LOCAL_RANK", rank)),
            master_addr=env.get("MASTER_ADDR", "localhost"),
            master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
            launcher="explicit",
        )
    else:
        info = detect_launch(env)
    backend = backend or default_backend(info.world_size, env)
    if torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    _bind_world_defaults_to_none()
    timeout = datetime.timedelta(seconds=timeout_s)
    restart = env.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{info.master_addr}:{info.master_port}",
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
        )
        return info
    # Under torchrun the agent hosts the store at MASTER_ADDR:MASTER_PORT and
    # keeps it across restarts (--max-restarts): ranks of a restarted attempt
    # would read the dead attempt's Gloo addresses from it and time out
    # connecting to them. Each attempt's keys get their own prefix.
    agent_hosts = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        info.master_addr, info.master_port, info.world_size, is_master=not agent_hosts and info.rank == 0, timeout=timeout
    )
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"minddp/attempt-{restart}", store),
        rank=info.rank,
        world_size=info.world_size,
        timeout=timeout,
    )
    return info


def _bind_world_defaults_to_none() -> None:
    """Import ``torch.distributed.nn.functional`` while no group exists
    (the second cause in [Note: a group must die before the interpreter])."""
    if not dist.is_initialized():
        import torch.distributed.nn.functional  # noqa: F401


def shutdown(*, wait_for_peers: bool = True) -> None:
    """Leave together, then destroy the default group (the normal end of a job).

    The barrier matters: a rank that tears down its sockets while a peer's
    Gloo thread is still finishing the last collective can make that peer
    fail. After a failure, pass ``wait_for_peers=False`` (or just exit): a
    barrier with a dead peer would wait for the whole timeout.

    [Note: a group must die before the interpreter]
    ``destroy_process_group`` drops torch's references to the group; the group
    itself, and its Gloo threads, go when the last reference does. If that is
    only at interpreter exit, a worker thread still letting go of the last
    collective's tensors there cannot take the GIL, and the process aborts
    ("terminate called without an active exception") after training
    succeeded: rarely, and more often on a loaded machine. Two references
    outlive the call in ordinary training code:

    * Garbage in a reference cycle (a wrapper and its parts, say) holds the
      group until the collector next runs: collected here, at once.
    * ``torch.distributed.nn.functional`` writes its collectives as
      ``def all_reduce(..., group=group.WORLD)``, and Python evaluates a
      default once, at import. Imported after ``init_process_group``, as
      happens when the first optimizer is built (``torch.optim`` imports
      ``torch._dynamo``, which imports it), its defaults hold the group for
      good. :func:`init_distributed` imports it before the group exists, so
      they are ``None``: the default group at each call, as everywhere else.
    """
    if dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()
        gc.collect()


@contextlib.contextmanager
def distributed(backend: str | None = None, **kwargs) -> Iterator[LaunchInfo]:
    """``with distributed() as info:`` -- a process group that is always destroyed."""
    info = init_distributed(backend, **kwargs)
    try:
        yield info
    except BaseException:
        shutdown(wait_for_peers=False)
        raise
    shutdown()
