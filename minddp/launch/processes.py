"""Start N local ranks, watch them, and tell which one failed first.

When one rank of a data-parallel job fails, the others soon fail too: their
next collective finds a closed socket (Gloo) or waits for the process-group
timeout (NCCL). The error worth showing is the *first* one; the rest are
echoes. So a rank does not print its error: it sends a report to the parent
over a pipe, stamped with the time it happened, and the parent sorts.

:class:`LocalRanks` is the one supervisor of the package. Three callers
build on it: :func:`minddp.launch.spawn`, the ``minddp-train`` program's
local launch (``--nproc``) and the test harness :class:`minddp_lab.rank_pool.RankPool`
(which keeps its ranks alive between calls). The protocol:

* a rank runs ``target(rank, conn, *args)`` and calls :func:`report` with a
  kind: ``"ok"`` (a result), ``"note"`` (news on the way, e.g. "checkpoint
  saved"; not final) or anything else (a failure, e.g. ``"error"``);
* a rank does not see its launcher's variables (``LOCAL_RANK``,
  ``TORCHELASTIC_*``, ``SLURM_PROCID``, ...): it was started here, not by
  the launcher;
* a rank that dies without a word (SIGKILL, the OOM killer, a segfault,
  ``os._exit``) is seen through its process sentinel and reported as
  ``"died"``;
* after the first failure the others get ``grace_s`` seconds to report,
  then :meth:`LocalRanks.collect` returns and the caller kills the rest.

Every rank asks the kernel to kill it when its parent dies, so an
interrupted parent (even by SIGKILL) never leaves orphan ranks behind.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

__all__ = ["LocalRanks", "Report", "report", "die_with_parent", "describe_exit", "GRACE_S"]

# After the first failure, how long the other ranks get to report before they
# are killed: long enough to raise their own (usually consequential) error,
# short enough that a rank stuck in a collective does not stall the caller.
GRACE_S = 3.0


@dataclass(frozen=True)
class Report:
    """What one rank said (or how it died), and when."""

    rank: int
    kind: str  # "ok", "died", or the failure kind the rank sent ("error", ...)
    value: Any
    at: float  # time.monotonic() when it happened (one clock for every process of a machine)

    @property
    def failed(self) -> bool:
        return self.kind != "ok"


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (elsewhere: nothing)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def report(conn: Connection, kind: str, value: Any = None) -> None:
    """Send the parent a report (from a rank). Falls back to an error if ``value`` cannot be pickled."""
    now = time.monotonic()
    try:
        payload = pickle.dumps((kind, value, now))
    except Exception:  # noqa: BLE001 -- pickling can raise almost anything
        payload = pickle.dumps(("error", "result could not be pickled:\n" + traceback.format_exc(), now))
    conn.send_bytes(payload)


def describe_exit(exitcode: int | None) -> str:
    """Why a process ended without a report, in words."""
    if exitcode is None:
        return "did not stop"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (out of memory, or killed by the scheduler or a user?)" if name == "SIGKILL" else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {exitcode} without reporting an error (os._exit, or a crash in native code)"


# What a launcher tells its processes. A rank started here must not read its
# parent's: under torchrun every child would take the parent's LOCAL_RANK
# (one GPU for all) and its restart count (a store it does not have).
LAUNCHER_VARIABLES = re.compile(
    r"(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|ROLE_WORLD_SIZE|GROUP_WORLD_SIZE|"
    r"TORCHELASTIC_.*|SLURM_(PROCID|LOCALID|NTASKS|NTASKS_PER_NODE|NODEID)|OMPI_COMM_WORLD_.*)"
)


def _forget_launcher() -> None:
    for name in [n for n in os.environ if LAUNCHER_VARIABLES.fullmatch(n)]:
        del os.environ[name]


def _rank_main(target: Callable[..., None], rank: int, conn: Connection, args: tuple) -> None:
    die_with_parent()
    _forget_launcher()
    try:
        target(rank, conn, *args)
    except BaseException:  # noqa: BLE001 -- what the target did not report itself
        report(conn, "error", traceback.format_exc().rstrip())
        sys.stdout.flush()
        os._exit(1)  # skip the orderly teardown: with a dead peer it may block


class LocalRanks:
    """``world_size`` processes on this machine, each running ``target(rank, conn, *args)``.

    ``method`` is the multiprocessing start method: ``"spawn"`` (a fresh
    interpreter; the only safe choice once CUDA or threads exist) or
    ``"fork"`` (much faster to start: the ranks inherit the parent's imports).
    ``daemon=True`` ranks are killed when the parent's interpreter exits
    (instead of being waited for), but cannot start processes of their own
    (no DataLoader workers).
    """

    def __init__(
        self,
        world_size: int,
        target: Callable[..., None],
        args: tuple = (),
        *,
        method: str = "spawn",
        daemon: bool = False,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        ctx = mp.get_context(method)
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main, args=(target, rank, child, args), name=f"minddp-rank{rank}", daemon=daemon
            )
            proc.start()
            child.close()  # the rank holds the only other end: its death closes the pipe
            self.procs.append(proc)
            self.conns.append(parent)

    def send_all(self, message: Any) -> None:
        """Send every rank the same message (pickled once)."""
        payload = pickle.dumps(message)
        for conn in self.conns:
            conn.send_bytes(payload)

    def collect(
        self,
        timeout_s: float | None = None,
        grace_s: float = GRACE_S,
        on_note: Callable[[int, Any], None] | None = None,
    ) -> tuple[list[Report], list[int]]:
        """Wait for one final report from every rank.

        Returns the reports in the order they happened and the ranks that had
        not reported when time ran out (``timeout_s`` in all, or ``grace_s``
        after the first failure). Notes go to ``on_note(rank, value)``.
        """
        reports: list[Report] = []
        waiting = set(range(len(self.procs)))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while waiting:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            watch: dict[Any, int] = {}
            for rank in waiting:
                watch[self.conns[rank]] = rank
                watch[self.procs[rank].sentinel] = rank
            for rank in {watch[ready] for ready in wait(list(watch), timeout=remaining)}:
                final = self._read(rank, on_note)
                if final is None:
                    continue  # only notes; the rank goes on
                reports.append(final)
                waiting.discard(rank)
                if final.failed:
                    first_failure = time.monotonic() + grace_s
                    deadline = first_failure if deadline is None else min(deadline, first_failure)
        reports.sort(key=lambda r: r.at)
        return reports, sorted(waiting)

    def _read(self, rank: int, on_note: Callable[[int, Any], None] | None) -> Report | None:
        """This rank's final report if it has one (draining notes first), a death, or None."""
        conn, proc = self.conns[rank], self.procs[rank]
        try:
            while conn.poll():
                kind, value, at = conn.recv()
                if kind != "note":
                    return Report(rank, kind, value, at)
                if on_note is not None:
                    on_note(rank, value)
        except (EOFError, OSError):
            pass  # the pipe closed: the process is gone
        else:
            if proc.is_alive():
                return None
        proc.join(1.0)
        return Report(rank, "died", describe_exit(proc.exitcode), time.monotonic())

    def close(self, wait_s: float = 0.0) -> None:
        """Give the ranks ``wait_s`` seconds to exit, kill the rest, reap them all. Safe to call twice."""
        deadline = time.monotonic() + wait_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
