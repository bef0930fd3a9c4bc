"""Run a function on N ranks, turning every hang and crash into an exception.

Distributed code fails in two nasty ways: one rank raises while the others
wait forever in a collective, or every rank waits forever because collectives
were issued in a different order. A test harness must turn both into a plain
failure with the guilty rank's traceback, within a time limit, and leave no
process behind. That is :class:`RankPool`.

Starting a rank costs about two seconds (importing torch, meeting over TCP),
and the suite holds many distributed tests. So a pool keeps its ranks alive
between calls, each already inside a Gloo process group, and only restarts
them after a failure (when their group may be half way through a collective
and can no longer be trusted)::

    pool = RankPool(world_size=2)
    results = pool.run(fn, arg)      # [fn(0, 2, arg), fn(1, 2, arg)]
    pool.close()

``fn`` must be defined at module level (it is sent to the ranks by name) and
takes ``(rank, world_size, *args)``. Results travel back pickled.
"""

from __future__ import annotations

import os
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

from minddp.launch import find_free_port, init_distributed, shutdown
from minddp.launch.processes import LocalRanks, report

__all__ = ["RankError", "RankPool"]


class RankError(RuntimeError):
    """A rank raised, died, or did not answer in time."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


def _serve(rank: int, conn: Connection, world_size: int, port: int, init_group: bool, threads: int) -> None:
    """One rank of the pool: join the group, then run what the parent sends until told to stop."""
    import torch

    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if init_group:
        init_distributed("gloo", rank=rank, world_size=world_size, timeout_s=60)
    report(conn, "ok")  # ready
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone: leave the group all the same (a clean exit)
            break
        if message is None:
            break
        fn, args, kwargs = message
        try:
            result = fn(rank, world_size, *args, **kwargs)
        except BaseException:  # noqa: BLE001 -- sent to the parent; the rank serves on
            report(conn, "error", traceback.format_exc())
        else:
            report(conn, "ok", result)
    shutdown(wait_for_peers=False)  # the parent tells each rank on its own


class RankPool:
    """``world_size`` processes that run functions together, kept alive between calls.

    Life cycle: started lazily by the first :meth:`run`; after any failure
    every rank is killed and the next :meth:`run` starts fresh ones;
    :meth:`close` ends them. ``init_group=False`` gives ranks without a
    process group, for tests of code that creates its own. The processes are
    a :class:`minddp.launch.processes.LocalRanks` (spawned: never fork a process
    that may hold threads).
    """

    def __init__(self, world_size: int, *, init_group: bool = True, threads_per_rank: int = 1):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.init_group = init_group
        self.threads_per_rank = threads_per_rank
        self._ranks: LocalRanks | None = None

    @property
    def _procs(self) -> list:
        """The live rank processes (empty when none runs)."""
        return self._ranks.procs if self._ranks is not None else []

    # -- life cycle -------------------------------------------------------
    def _start(self, timeout_s: float) -> None:
        args = (self.world_size, find_free_port(), self.init_group, self.threads_per_rank)
        # Daemons: a pool left open ends with the interpreter instead of keeping it waiting.
        self._ranks = LocalRanks(self.world_size, _serve, args, daemon=True)
        self._collect(timeout_s, what="start")

    def close(self) -> None:
        """Ask every rank to stop, kill those that do not within 2 s, reap them; safe to call twice."""
        if self._ranks is None:
            return
        try:
            self._ranks.send_all(None)
        except (OSError, ValueError):
            pass  # a rank already gone
        self._ranks.close(wait_s=2.0)
        self._ranks = None

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running ----------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args, timeout_s: float = 60.0, **kwargs) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank.

        Returns the per-rank results in rank order. Raises :class:`RankError`
        for the first rank that raised (with its traceback), died, or had not
        answered after ``timeout_s``; the pool is then restarted on next use.
        """
        if self._ranks is None:
            self._start(timeout_s)
        self._ranks.send_all((fn, args, kwargs))
        return self._collect(timeout_s, what=getattr(fn, "__name__", repr(fn)))

    def _collect(self, timeout_s: float, what: str) -> list[Any]:
        reports, waiting = self._ranks.collect(timeout_s)
        failures = [r for r in reports if r.failed]
        if failures:
            first = failures[0]
            kind = "died" if first.kind == "died" else "raised"
            failure = RankError(first.rank, f"rank {first.rank} {kind} in {what}:\n{first.value}")
        elif waiting:
            failure = RankError(
                waiting[0],
                f"{what}: rank(s) {waiting} did not finish within {timeout_s:.0f} s "
                "(a hang: mismatched collectives, or a rank waiting for one that failed)",
            )
        else:
            return [r.value for r in sorted(reports, key=lambda r: r.rank)]
        self.close()
        raise failure
