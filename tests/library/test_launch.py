"""Environment detection (no process group needed) and real launches."""

import subprocess
import sys
import textwrap

import pytest

from minddp.launch import detect_launch, find_free_port, parse_slurm_nodelist


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("node7", ["node7"]),
        ("a[8-10],b1", ["a8", "a9", "a10", "b1"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("x[1,3],y[2-3]", ["x1", "x3", "y2", "y3"]),
        ("rack1-n[1-2]", ["rack1-n1", "rack1-n2"]),
    ],
)
def test_slurm_nodelist_expansion(nodelist, hosts):
    assert parse_slurm_nodelist(nodelist) == hosts


def test_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}
    info = detect_launch(env)
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port, info.launcher) == (
        3, 8, 1, "h0", 1234, "torchrun")


def test_slurm_environment_takes_the_first_host_as_master():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODELIST": "gpu[07-08,11]"}
    info = detect_launch(env)
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port) == (5, 8, 1, "gpu07", 29500)
    assert detect_launch({**env, "MASTER_ADDR": "login", "MASTER_PORT": "4000"}).master_addr == "login"


def test_openmpi_environment():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "MASTER_ADDR": "m", "MASTER_PORT": "7000"}
    info = detect_launch(env)
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.launcher) == (2, 4, 0, "m", "openmpi")


@pytest.mark.parametrize(
    "env,missing",
    [
        ({"RANK": "0", "MASTER_ADDR": "h"}, "WORLD_SIZE, MASTER_PORT"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_LOCALID"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, "MASTER_ADDR"),
    ],
)
def test_incomplete_environment_names_the_missing_variables(env, missing):
    with pytest.raises(RuntimeError, match=f"lacks {missing}"):
        detect_launch(env)


def test_no_launcher_at_all():
    with pytest.raises(RuntimeError, match="no launcher found"):
        detect_launch({})


SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from minddp import distributed
    with distributed("gloo") as info:
        t = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(t)
        print(f"rank={info.rank} world={info.world_size} launcher={info.launcher} sum={t.item():g}")
    assert not dist.is_initialized()
    """
)


def test_launch_helper_under_torchrun_with_two_processes(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(find_free_port()), str(script)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        assert f"rank={rank} world=2 launcher=torchrun sum=3" in out.stdout


def _collect(rank, world_size, path):
    import torch.distributed as dist

    with open(f"{path}/{rank}", "w") as f:
        f.write(f"{dist.get_rank()}/{dist.get_world_size()}")


def test_spawn_runs_every_rank_in_a_group(tmp_path):
    from minddp import spawn

    spawn(_collect, 2, str(tmp_path), backend="gloo")
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["0/2", "1/2"]


def _set_up(path, rank):
    # Runs in the rank's process before its group exists (where the lab enters a rank's network namespace).
    import torch.distributed as dist

    assert not dist.is_initialized()
    with open(f"{path}/set-up-{rank}", "w") as f:
        f.write(str(rank))


def _saw_its_set_up(rank, world_size, path):
    with open(f"{path}/set-up-{rank}") as f:
        assert f.read() == str(rank)
    _collect(rank, world_size, path)


def test_spawn_runs_each_ranks_setup_in_its_process_before_the_group(tmp_path):
    import functools

    from minddp import spawn

    spawn(_saw_its_set_up, 2, str(tmp_path), backend="gloo", rank_setup=functools.partial(_set_up, str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "set-up-0", "set-up-1"]


def test_the_labs_spawn_without_a_link_is_the_librarys(tmp_path):
    from minddp_lab.links import spawn

    spawn(_collect, 2, str(tmp_path), backend="gloo", link="loopback")
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["0/2", "1/2"]


def _rank1_fails_rank0_waits(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("the real cause, on rank 1")
    dist.all_reduce(torch.zeros(1))  # rank 0 fails only as a consequence


def test_spawn_reports_the_rank_that_failed_first():
    from minddp import spawn
    from minddp.launch import RankFailed

    with pytest.raises(RankFailed, match="rank 1 failed first") as info:
        spawn(_rank1_fails_rank0_waits, 2, backend="gloo")
    assert "ValueError: the real cause, on rank 1" in str(info.value)


def test_free_ports_come_from_below_the_ephemeral_range_and_ignore_the_global_seed():
    """Gloo's own connections take ephemeral ports (32768 and up on Linux); a
    meeting port picked there was now and then taken before rank 0 bound it
    (EADDRINUSE under load). A seeded script must not pin the choice either:
    two runs seeded alike would then meet on the same port."""
    import random

    ports = set()
    for _ in range(5):
        random.seed(0)
        ports.add(find_free_port())
    assert all(1024 < p < 32768 for p in ports), ports
    assert len(ports) > 1, f"the global seed decided the port: {ports}"


LEAVE = textwrap.dedent(
    """
    import os, sys, torch
    from minddp.launch import find_free_port, init_distributed, shutdown

    init_distributed("gloo", rank=0, world_size=1, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())})
    model = torch.nn.Linear(4, 2)
    torch.optim.SGD(model.parameters(), lr=0.1)  # imports torch._dynamo, and through it torch.distributed.nn
    import torch.distributed.nn.functional  # in case this torch's optimizer did not
    model(torch.ones(3, 4)).sum().backward()

    class Cycle:  # garbage the collector has not met yet, holding the group (a wrapper's parts can)
        pass

    cycle = Cycle()
    cycle.itself, cycle.group = cycle, torch.distributed.group.WORLD
    del cycle
    shutdown()
    threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    print(sorted(name for name in threads if "gloo" in name))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc")
def test_shutdown_stops_the_groups_threads_before_the_interpreter_exits():
    # A Gloo thread alive at interpreter exit can abort the process after a
    # successful run ([Note: a group must die before the interpreter]).
    out = subprocess.run([sys.executable, "-c", LEAVE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"Gloo threads still running after shutdown(): {out.stdout}"
