"""Run ``minddp-train`` on ``--nproc`` local ranks and say which one failed first.

The ranks are a :class:`minddp.launch.processes.LocalRanks`: each trains and sends
the parent what happened, and the parent prints it. The reports of a rank:

* ``("note", step)``     after each checkpoint (to name the last good one),
* ``("ok", summary)``     done,
* ``("usage", message)``  bad input (a checkpoint of another model, ...),
* ``("error", (text, line, consequential))`` it raised: traceback, one-line
  summary, and whether it looks like a consequence of a peer's failure.

A rank that dies without a word is reported by the supervisor. After the
first failure the others get ``min(--timeout-s, GRACE_S)`` seconds to stop by
themselves, then are killed. The parent then prints the first real failure
in full (a death, a usage error, or an exception that is not a communication
error, earliest first) and the others' consequential errors in one line.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection

import torch

from minddp.launch import find_free_port, init_distributed, shutdown
from minddp.launch.processes import LocalRanks, Report, report
from minddp_lab.train.checkpoint import LAST, CheckpointError
from minddp_lab.train.errors import UsageError, describe_exception, is_communication_error
from minddp_lab.train.loop import train

__all__ = ["run_local", "GRACE_S"]

# Longer than the test harness's grace: a rank may be in the middle of saving a checkpoint.
GRACE_S = 10.0


def _rank(rank: int, conn: Connection, world_size: int, port: int, threads: int, args: argparse.Namespace) -> None:
    # A Ctrl-C in the terminal reaches the whole process group; let the parent
    # decide, so the ranks do not all print a KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        init_distributed(args.backend, rank=rank, world_size=world_size, timeout_s=args.timeout_s)
        summary = train(args, rank, world_size, rank, on_saved=lambda step: report(conn, "note", step))
    except (UsageError, CheckpointError) as exc:
        report(conn, "usage", str(exc))
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent
        report(conn, "error", (traceback.format_exc().rstrip(), describe_exception(exc), is_communication_error(exc)))
    else:
        report(conn, "ok", summary)
        shutdown()
        return
    # After a failure, skip the orderly teardown: with a dead peer it may block.
    sys.stdout.flush()
    os._exit(1)


def _start_method(args: argparse.Namespace) -> str:
    """``fork`` where it is safe, else ``spawn``.

    Every fresh Python process pays for importing torch, and torch.optim
    imports ``torch._dynamo`` on first use: together several seconds, per
    rank. Forked ranks inherit the parent's imports instead. Forking is safe
    while the parent has no other thread and has touched no GPU: this parent
    only imported modules. With NCCL (CUDA) the ranks are spawned.
    """
    if args.backend != "gloo" or "fork" not in mp.get_all_start_methods():
        return "spawn"
    # Imported here, not at the top: only forked ranks profit, and --help need not wait for it.
    import torch._dynamo  # noqa: F401 -- what torch.optim would import in every rank

    return "spawn" if threading.active_count() > 1 else "fork"


def run_local(args: argparse.Namespace, nproc: int) -> int:
    """Train with ``nproc`` local ranks; return the process exit code (0, 1 failure, 2 bad input)."""
    # The cores shared out over the ranks, unless OMP_NUM_THREADS says how many each takes
    # (as it does under torchrun: the same thread count gives the same float sums).
    threads = max(1, (os.cpu_count() or 1) // nproc)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        threads = int(os.environ["OMP_NUM_THREADS"])
    ranks = LocalRanks(nproc, _rank, (nproc, find_free_port(), threads, args), method=_start_method(args))
    saved: list[int] = []  # steps of the checkpoints written, as the notes arrive
    grace = min(args.timeout_s, GRACE_S)
    try:
        reports, stragglers = ranks.collect(grace_s=grace, on_note=lambda rank, step: saved.append(step))
    except KeyboardInterrupt:
        ranks.close()
        _say("interrupted; ranks stopped")
        return 130
    ranks.close()
    return _report(args, reports, stragglers, grace, saved[-1] if saved else None)


def _say(text: str) -> None:
    print(f"minddp-train: {text}", file=sys.stderr, flush=True)


def _is_echo(report: Report) -> bool:
    """A communication error: most likely the consequence of another rank's failure."""
    return report.kind == "error" and report.value[2]


def _one_line(report: Report) -> str:
    return report.value[1] if report.kind == "error" else report.value


def _report(
    args: argparse.Namespace, reports: list[Report], stragglers: list[int], grace: float, last_saved: int | None
) -> int:
    failures = [r for r in reports if r.failed]
    if not failures and not stragglers:
        return 0
    usage = [r.value for r in failures if r.kind == "usage"]
    if usage and all(r.kind == "usage" or _is_echo(r) for r in failures):
        _say(f"error: {usage[0]}")  # the same bad input on every rank: one line
        return 2
    # The first failure that is not a communication error is the cause;
    # if every failure is one (a network problem), the earliest is.
    first = ([r for r in failures if not _is_echo(r)] or failures)[0]
    if first.kind == "died":
        _say(f"rank {first.rank} failed first: it {first.value}")
    elif first.kind == "usage":
        _say(f"rank {first.rank} failed first: {first.value}")
    else:
        _say(f"rank {first.rank} failed first:\n{first.value[0]}")
    others = [f"rank {r.rank}: {_one_line(r)}" for r in failures if r is not first]
    if others:
        _say("then the others stopped: " + "; ".join(others))
    if stragglers:
        _say(f"rank(s) {', '.join(map(str, stragglers))} had not stopped {grace:.0f} s after that; killed")
    last = os.path.join(args.checkpoint_dir, LAST) if args.checkpoint_dir else None
    if last and os.path.exists(last):
        when = f" (step {last_saved})" if last_saved is not None else ""
        _say(f"last good checkpoint: {last}{when}; continue with --resume")
    return 1
