"""Start the ranks of one machine as processes of this one (``mp.spawn``'s job), on a free port.

:func:`spawn` runs ``fn(rank, world_size, *args)`` in each rank, each in a
process group of its own making, after an optional setup of its own
(``rank_setup``: the lab's real shaped links enter a rank's network namespace
there); a rank that raises stops the others and its traceback is raised here as
:class:`RankFailed`.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import traceback
from typing import Callable

from minddp.launch.processes import GRACE_S, LocalRanks, report
from minddp.launch.process_group import distributed

__all__ = ["find_free_port", "spawn", "RankFailed"]


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
    rank: int, conn, fn: Callable, world_size: int, port: int, backend: str | None, args: tuple,
    rank_setup: Callable[[int], None] | None = None,
) -> None:
    # LocalRanks cleared the launcher's variables; what torchrun would say for one machine, for code that reads it (pick a GPU by LOCAL_RANK).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if rank_setup is not None:  # e.g. a real link: this rank's own network namespace, address and interface
        rank_setup(rank)
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
    rank_setup: Callable[[int], None] | None = None,
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` local processes,
    each inside an initialised process group on a free port.

    Built on :class:`minddp.launch.processes.LocalRanks`. If ranks fail, the others
    get a few seconds, then are killed, and :class:`RankFailed` shows the
    traceback of the rank that failed *first* (usually the cause; the rest
    are consequences, named in one line). ``fn`` must be importable by name
    (defined at module level), as for any spawn. ``start_method="fork"``
    starts the ranks from a copy of this process, its imports included
    (seconds faster; only safe on Linux and before CUDA is initialised).

    ``rank_setup(rank)``, if given, runs in each rank's process before its
    process group is made (picklable, like ``fn``).

    Real shaped links between the ranks (network namespaces, a rate) are the
    lab's: ``minddp_lab.links.spawn(fn, world_size, *args, link="1gbit")``.
    """
    spawn_args = (fn, world_size, find_free_port(), backend, args, rank_setup)
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
