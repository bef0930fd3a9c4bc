"""Start a process group from whatever launched this process.

Every launcher tells a process three things: who am I (global rank), how many
of us are there (world size), and where do we meet (master address and port).
They just spell it differently:

============  ======================  ===================  ====================
launcher      rank                    world size           local rank
============  ======================  ===================  ====================
torchrun      ``RANK``                ``WORLD_SIZE``       ``LOCAL_RANK``
SLURM srun    ``SLURM_PROCID``        ``SLURM_NTASKS``     ``SLURM_LOCALID``
OpenMPI       ``OMPI_COMM_WORLD_RANK``  ``..._SIZE``       ``..._LOCAL_RANK``
mp.spawn      the function argument   you pass it          = rank (one machine)
============  ======================  ===================  ====================

torchrun also sets ``MASTER_ADDR``/``MASTER_PORT``. Under SLURM the master is
the first host of ``SLURM_NODELIST`` (a compressed list such as
``gpu[01-03,07]``); under OpenMPI it must be exported by the user
(``mpirun -x MASTER_ADDR -x MASTER_PORT``) because OpenMPI has no such notion.

:func:`detect_launch` only reads an environment mapping, so it is tested
without any process group. :func:`distributed` is the context manager a
training script wraps itself in; it always destroys the group, also when the
body raises, so a crashed rank does not leave sockets and threads behind.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import re
import socket
import sys
import traceback
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

import minddp.links as links
from minddp.processes import GRACE_S, LocalRanks, report

__all__ = [
    "LaunchInfo",
    "detect_launch",
    "parse_slurm_nodelist",
    "init_distributed",
    "default_backend",
    "distributed",
    "find_free_port",
    "spawn",
    "shutdown",
    "RankFailed",
]

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm", "openmpi" or "explicit"


def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list: ``"gpu[01-03,07],cpu1"`` ->
    ``["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]``.

    Zero padding is kept (``[08-10]`` -> ``08, 09, 10``). Only one bracket
    group per host name is supported, which is what SLURM prints.
    """
    hosts: list[str] = []
    # Split on commas that are not inside brackets.
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        item = item.strip()
        if not item:
            continue
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if match is None:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                width = len(lo)
                for n in range(int(lo), int(hi) + 1):
                    hosts.append(f"{prefix}{n:0{width}d}{suffix}")
            else:
                hosts.append(f"{prefix}{part}{suffix}")
    if not hosts:
        raise ValueError(f"SLURM node list {nodelist!r} names no host")
    return hosts


def _require(env: Mapping[str, str], launcher: str, names: list[str]) -> dict[str, str]:
    missing = [n for n in names if n not in env]
    if missing:
        raise RuntimeError(
            f"this looks like a {launcher} launch, but the environment lacks "
            f"{', '.join(missing)}; set {'them' if len(missing) > 1 else 'it'} "
            "or start the processes through minddp.launch.spawn"
        )
    return {n: env[n] for n in names}


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read rank, world size, local rank and master from the environment.

    Checked in order: torchrun (``RANK`` or ``TORCHELASTIC_RUN_ID``), SLURM
    (``SLURM_PROCID``), OpenMPI (``OMPI_COMM_WORLD_RANK``). Raises
    ``RuntimeError`` naming the missing variables when a launcher is
    recognised but incomplete, and when none is recognised at all.
    """
    env = os.environ if env is None else env
    if "RANK" in env or "TORCHELASTIC_RUN_ID" in env:
        v = _require(env, "torchrun", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
        return LaunchInfo(
            rank=int(v["RANK"]),
            world_size=int(v["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", v["RANK"])),
            master_addr=v["MASTER_ADDR"],
            master_port=int(v["MASTER_PORT"]),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env:
        v = _require(env, "SLURM", ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"])
        if "MASTER_ADDR" in env:
            master = env["MASTER_ADDR"]
        else:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if nodelist is None:
                raise RuntimeError(
                    "this looks like a SLURM launch, but neither MASTER_ADDR nor "
                    "SLURM_NODELIST/SLURM_JOB_NODELIST is set, so the master is unknown"
                )
            master = parse_slurm_nodelist(nodelist)[0]
        return LaunchInfo(
            rank=int(v["SLURM_PROCID"]),
            world_size=int(v["SLURM_NTASKS"]),
            local_rank=int(v["SLURM_LOCALID"]),
            master_addr=master,
            master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
            launcher="slurm",
        )
    if "OMPI_COMM_WORLD_RANK" in env:
        v = _require(
            env,
            "OpenMPI",
            ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "MASTER_ADDR"],
        )
        return LaunchInfo(
            rank=int(v["OMPI_COMM_WORLD_RANK"]),
            world_size=int(v["OMPI_COMM_WORLD_SIZE"]),
            local_rank=int(v["OMPI_COMM_WORLD_LOCAL_RANK"]),
            master_addr=v["MASTER_ADDR"],
            master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
            launcher="openmpi",
        )
    raise RuntimeError(
        "no launcher found: set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
        "(torchrun does), run under srun or mpirun, or pass rank and world_size "
        "explicitly (minddp.launch.spawn does)"
    )


def ranks_on_this_machine(world_size: int, env: Mapping[str, str] | None = None) -> int:
    """How many ranks share this machine: what the launcher says, else ``world_size`` (one machine)."""
    env = os.environ if env is None else env
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        match = re.match(r"\d+", env.get(name, ""))  # SLURM may say "4(x2)": 4 per node on 2 nodes
        if match:
            return int(match.group())
    return world_size


def default_backend(world_size: int = 1, env: Mapping[str, str] | None = None) -> str:
    """NCCL where every rank of this machine can have a GPU of its own, else Gloo.

    NCCL is the fast path for GPUs, but refuses two ranks on one GPU; with
    more ranks here than visible GPUs (or none) Gloo is the one that works.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if 0 < ranks_on_this_machine(world_size, env) <= gpus else "gloo"


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


def shutdown() -> None:
    """Leave together, then destroy the default group (the normal end of a job).

    The barrier matters: a rank that tears down its sockets while a peer's
    Gloo thread is still finishing the last collective can make that peer
    abort at exit ("terminate called without an active exception"). After a
    failure, call ``dist.destroy_process_group()`` alone (or just exit): a
    barrier with a dead peer would wait for the whole timeout.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed(backend: str | None = None, **kwargs) -> Iterator[LaunchInfo]:
    """``with distributed() as info:`` -- a process group that is always destroyed."""
    info = init_distributed(backend, **kwargs)
    try:
        yield info
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    shutdown()


def find_free_port() -> int:
    """A TCP port that was free a moment ago, chosen below the OS's ephemeral range.

    Rank 0 binds the port a moment later, and in between anything may take
    it. A port the OS hands out (``bind(0)``) comes from the ephemeral range,
    the very range Gloo's own connections draw from, so on a busy machine it
    was taken now and then (``EADDRINUSE``). Linux's ephemeral range starts at
    32768; a random free port below it is only taken by someone who asks for
    it by number.
    """
    pick = random.SystemRandom()  # not the global generator: a seeded script would pick the same port every time
    for _ in range(50):
        port = pick.randrange(20000, 32768)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """A rank of :func:`spawn` raised; the message holds the first failure's traceback."""


def _spawn_rank(
    rank: int, conn, fn: Callable, world_size: int, port: int, backend: str | None, args: tuple, seats: list | None = None
) -> None:
    # LocalRanks cleared the launcher's variables; what torchrun would say for one machine, for code that reads it (pick a GPU by LOCAL_RANK).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if seats is not None:  # a real link: this rank's own network namespace, address and interface
        links.enter(seats[rank])
    with distributed(backend, rank=rank, world_size=world_size):
        try:
            fn(rank, world_size, *args)
        except BaseException:
            # Report the failure *before* the process group is torn down: the
            # other ranks fail because of it a moment later ("Connection reset
            # by peer"), and the parent wants to show the cause, not the echo.
            report(conn, "error", traceback.format_exc().rstrip())
            sys.stdout.flush()
            os._exit(1)
    report(conn, "ok")
    # Done, reported, and the group destroyed: leave without the interpreter's
    # teardown, where Gloo's C++ threads can still abort the process now and
    # then ("terminate called without an active exception", SIGABRT; seen
    # about once in 25 lesson runs; pytorch/pytorch PR 179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(
    fn: Callable,
    world_size: int,
    *args,
    backend: str | None = None,
    start_method: str = "spawn",
    link: str | None = None,
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` local processes,
    each inside an initialised process group on a free port.

    Built on :class:`minddp.processes.LocalRanks`. If ranks fail, the others
    get a few seconds, then are killed, and :class:`RankFailed` shows the
    traceback of the rank that failed *first* (usually the cause; the rest
    are consequences, named in one line). ``fn`` must be importable by name
    (defined at module level), as for any spawn. ``start_method="fork"``
    starts the ranks from a copy of this process, its imports included
    (seconds faster; only safe on Linux and before CUDA is initialised).

    ``link="1gbit"`` (any rate :func:`minddp.links.parse_rate` accepts):
    each rank runs in a network namespace of its own, joined to the others
    by links shaped to that rate (:mod:`minddp.links`), so that Gloo's
    traffic crosses a real, rate-limited network instead of loopback. The
    namespaces are removed when the ranks end, however they end. Needs root.
    """
    if link is None or link == "loopback":
        return _run_ranks(fn, world_size, args, backend, start_method, seats=None)
    with links.shaped_network(world_size, link) as net:
        return _run_ranks(fn, world_size, args, backend, start_method, [net.seat(r) for r in range(world_size)])


def _run_ranks(fn: Callable, world_size: int, args: tuple, backend: str | None, start_method: str, seats) -> None:
    spawn_args = (fn, world_size, find_free_port(), backend, args, seats)
    ranks = LocalRanks(world_size, _spawn_rank, spawn_args, method=start_method)
    try:
        reports, stuck = ranks.collect()
    finally:
        ranks.close()
    failures = [r for r in reports if r.failed]
    if failures:
        first = failures[0]
        cause = f" it {first.value}" if first.kind == "died" else f"\n{first.value}"
        others = ", ".join(f"rank {r.rank}" for r in failures[1:])
        then = f"\n(then {others} failed too, most likely as a consequence)" if others else ""
        then += f"\n(rank(s) {', '.join(map(str, stuck))} had not stopped {GRACE_S:.0f} s later; killed)" if stuck else ""
        raise RankFailed(f"rank {first.rank} failed first:{cause}{then}")
