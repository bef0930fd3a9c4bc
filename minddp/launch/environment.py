"""Where this process sits in the job, read from whatever launched it.

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
without any process group; :mod:`minddp.launch.process_group` starts the group
from what it reads.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

import torch

__all__ = ["LaunchInfo", "detect_launch", "parse_slurm_nodelist", "ranks_on_this_machine", "default_backend"]

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
