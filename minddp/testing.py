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

import ctypes
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

__all__ = ["RankError", "RankPool", "run_ranks"]

# After the first rank fails, how long the others get to report before they
# are killed. Long enough for them to raise their own (usually matching)
# error, short enough that a rank stuck in a collective does not stall CI.
GRACE_S = 3.0


class RankError(RuntimeError):
    """A rank raised, died, or did not answer in time."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


def _die_with_parent() -> None:
    # Linux only: ask the kernel to SIGKILL us when the parent dies, so an
    # interrupted pytest (even with SIGKILL) leaves no rank behind.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def _worker(rank: int, world_size: int, port: int, init_group: bool, threads: int, conn: Connection) -> None:
    _die_with_parent()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        if init_group:
            import datetime

            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=60),
            )
        conn.send_bytes(pickle.dumps(("ready", None)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if message is None:
            break
        fn, args, kwargs = message
        try:
            reply = ("ok", fn(rank, world_size, *args, **kwargs))
        except BaseException:
            reply = ("error", traceback.format_exc())
        try:
            payload = pickle.dumps(reply)
        except Exception:
            payload = pickle.dumps(("error", "result could not be pickled:\n" + traceback.format_exc()))
        conn.send_bytes(payload)
    if init_group and dist.is_initialized():
        dist.destroy_process_group()


class RankPool:
    """``world_size`` processes that run functions together, kept alive between calls.

    Life cycle: started lazily by the first :meth:`run`; after any failure
    every rank is killed and the next :meth:`run` starts fresh ones;
    :meth:`close` ends them. ``init_group=False`` gives ranks without a
    process group, for tests of code that creates its own.
    """

    def __init__(self, world_size: int, *, init_group: bool = True, threads_per_rank: int = 1):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.init_group = init_group
        self.threads_per_rank = threads_per_rank
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []

    # -- life cycle -------------------------------------------------------
    def _start(self, timeout_s: float) -> None:
        from minddp.launch import find_free_port

        ctx = mp.get_context("spawn")  # never fork a process that may hold threads
        port = find_free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, port, self.init_group, self.threads_per_rank, child),
                daemon=True,
                name=f"minddp-rank{rank}",
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect(timeout_s, what="start")

    def close(self) -> None:
        """Kill every rank and reap it; safe to call twice."""
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

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
        if not self._procs:
            self._start(timeout_s)
        message = pickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(message)
        return self._collect(timeout_s, what=getattr(fn, "__name__", repr(fn)))

    def _collect(self, timeout_s: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        failure: RankError | None = None
        deadline = time.monotonic() + timeout_s
        waiting = set(range(self.world_size))
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            # A dead process closes its end of the pipe, so the pipe alone
            # tells "answered" and "died" apart.
            watch = {self._conns[r]: r for r in waiting}
            for ready in wait(list(watch), timeout=remaining):
                rank = watch[ready]
                if rank not in waiting:
                    continue
                try:
                    status, value = pickle.loads(self._conns[rank].recv_bytes())
                except (EOFError, OSError):  # the pipe closed: the process is gone
                    self._procs[rank].join(1.0)
                    status, value = "died", f"exit code {self._procs[rank].exitcode}"
                waiting.discard(rank)
                if status == "ok" or status == "ready":
                    results[rank] = value
                elif failure is None:
                    kind = "raised" if status == "error" else "died"
                    failure = RankError(rank, f"rank {rank} {kind} in {what}:\n{value}")
                    deadline = min(deadline, time.monotonic() + GRACE_S)
        if failure is None and waiting:
            failure = RankError(
                min(waiting),
                f"{what}: rank(s) {sorted(waiting)} did not finish within {timeout_s:.0f} s "
                "(a hang: mismatched collectives, or a rank waiting for one that failed)",
            )
        if failure is not None:
            self.close()
            raise failure
        return [results[r] for r in range(self.world_size)]


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 60.0, **kwargs) -> list[Any]:
    """One-off :class:`RankPool` run: start ranks, run ``fn``, stop them."""
    with RankPool(world_size) as pool:
        return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)
