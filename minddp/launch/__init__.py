"""Launching: where this process sits in the job, its process group, and local ranks.

* :mod:`~minddp.launch.environment`: rank, world size and master read from
  torchrun, SLURM, OpenMPI or explicit arguments (:func:`detect_launch`);
* :mod:`~minddp.launch.process_group`: :func:`init_distributed`,
  :func:`distributed` (a group that is always destroyed), :func:`shutdown`;
* :mod:`~minddp.launch.spawning`: :func:`spawn`, the ranks of one machine
  as processes of this one, on a free port (behind a real shaped link:
  the lab's ``minddp_lab.links.spawn``);
* :mod:`~minddp.launch.processes`: the local processes under all of them
  (a rank that dies, a parent that goes).
"""

from minddp.launch.environment import (
    LaunchInfo,
    default_backend,
    detect_launch,
    parse_slurm_nodelist,
    ranks_on_this_machine,
)
from minddp.launch.process_group import distributed, init_distributed, shutdown
from minddp.launch.spawning import RankFailed, find_free_port, spawn

__all__ = [
    "LaunchInfo",
    "RankFailed",
    "default_backend",
    "detect_launch",
    "distributed",
    "find_free_port",
    "init_distributed",
    "parse_slurm_nodelist",
    "ranks_on_this_machine",
    "shutdown",
    "spawn",
]
