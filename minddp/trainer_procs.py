"""Start local ranks for ``minddp-train``, watch them, and say which one failed first.

When one rank of a data-parallel job dies, every other rank soon fails too:
its next collective finds a closed socket (Gloo) or waits until the
process-group timeout (NCCL). Printing every rank's traceback buries the one
that matters under copies of "Connection closed by peer". So the ranks do not
print errors themselves; each sends what happened to this parent over a pipe:

* ``("saved", step)``     after each checkpoint (to name the last good one),
* ``("ok", summary)``     done,
* ``("usage", message)``  bad input (a checkpoint of another model, ...),
* ``("error", text, line, consequential)`` it raised: traceback, one-line
  summary, and whether it looks like a consequence of a peer's failure.

A rank that dies without a word (SIGKILL, the OOM killer, a segfault) is seen
through its process sentinel. After the first failure the others get
``min(--timeout-s, GRACE_S)`` seconds to stop by themselves, then are killed.
The parent then prints the first real failure in full (a death, a usage
error, or an exception that is not a communication error, earliest first)
and the others' consequential errors in one line.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["run_local", "is_communication_error", "describe_exception", "GRACE_S"]

GRACE_S = 10.0

_COMM_PATTERN = re.compile(
    r"gloo|nccl|connection (closed|reset|refused)|broken pipe|timed out|timeout|peer|socket|"
    r"process group|ProcessGroup|store",
    re.IGNORECASE,
)


def is_communication_error(exc: BaseException) -> bool:
    """Does ``exc`` look like the consequence of another rank failing (not a bug on this rank)?"""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, (RuntimeError, ConnectionError, TimeoutError)) and bool(_COMM_PATTERN.search(str(exc)))


def describe_exception(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message``, without Gloo's ``[/path/to/pair.cc:545]`` prefix, at most ``limit`` long."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first)
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _die_with_parent() -> None:
    # Linux: have the kernel SIGKILL this rank when the parent dies, so a
    # killed minddp-train (or pytest) never leaves orphan ranks behind.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _child(rank: int, world_size: int, port: int, threads: int, args: argparse.Namespace, conn: Connection) -> None:
    _die_with_parent()
    # A Ctrl-C in the terminal reaches the whole process group; let the parent
    # decide, so the ranks do not all print a KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch
    import torch.distributed as dist

    from minddp.checkpoint import CheckpointError
    from minddp.launch import init_distributed, shutdown
    from minddp.train import UsageError
    from minddp.trainer_loop import train

    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["LOCAL_RANK"] = str(rank)
    ok = False
    try:
        init_distributed(args.backend, rank=rank, world_size=world_size, timeout_s=args.timeout_s)
        summary = train(args, rank, world_size, rank, on_saved=lambda step: conn.send(("saved", step)))
        message: tuple = ("ok", summary)
        ok = True
    except (UsageError, CheckpointError) as exc:
        message = ("usage", str(exc))
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent
        message = ("error", traceback.format_exc().rstrip(), describe_exception(exc), is_communication_error(exc))
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass
    if ok:
        shutdown()
        return
    # After a failure, skip the orderly teardown: with a dead peer it may block.
    sys.stdout.flush()
    os._exit(1)


def _signal_name(exitcode: int | None) -> str:
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


def _start_method(args: argparse.Namespace):
    """``fork`` where it is safe, else ``spawn``.

    Every fresh Python process pays for importing torch, and torch.optim
    imports ``torch._dynamo`` on first use: together several seconds, per
    rank. Forked ranks inherit the parent's imports instead. Forking is safe
    while the parent has no other thread and has touched no GPU: this parent
    only imported modules. With NCCL (CUDA) the ranks are spawned.
    """
    if args.backend != "gloo" or "fork" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    import torch._dynamo  # noqa: F401 -- what torch.optim would import in every rank
    import minddp.trainer_loop  # noqa: F401
    import minddp.data  # noqa: F401
    import minddp.models  # noqa: F401

    if threading.active_count() > 1:
        return mp.get_context("spawn")
    return mp.get_context("fork")


def run_local(args: argparse.Namespace, nproc: int) -> int:
    """Train with ``nproc`` local ranks; return the process exit code (0, 1 failure, 2 bad input)."""
    from minddp.launch import find_free_port

    ctx = _start_method(args)
    threads = max(1, (os.cpu_count() or 1) // nproc)
    port = find_free_port()
    procs, conns = [], []
    for rank in range(nproc):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(rank, nproc, port, threads, args, child), name=f"minddp-rank{rank}")
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)

    outcome: dict[int, tuple] = {}  # rank -> final message, in arrival order (dicts keep order)
    last_saved: int | None = None
    deadline: float | None = None
    grace = min(args.timeout_s, GRACE_S)
    try:
        while len(outcome) < nproc:
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                break
            watch: dict[Any, tuple[str, int]] = {}
            for rank in range(nproc):
                if rank not in outcome:
                    watch[conns[rank]] = ("pipe", rank)
                    watch[procs[rank].sentinel] = ("proc", rank)
            for ready in wait(list(watch), timeout=timeout):
                kind, rank = watch[ready]
                if rank in outcome:
                    continue
                message = None
                if kind == "pipe" or conns[rank].poll():
                    try:
                        while True:  # drain: "saved" notes may precede the final word
                            message = conns[rank].recv()
                            if message[0] != "saved":
                                break
                            last_saved = message[1]
                            message = None
                            if not conns[rank].poll():
                                break
                    except (EOFError, OSError):
                        message = None
                if message is None:
                    if procs[rank].is_alive() and kind == "pipe":
                        continue  # only a "saved" note; the rank goes on
                    procs[rank].join(1.0)
                    message = ("died", _signal_name(procs[rank].exitcode))
                outcome[rank] = message
                if message[0] != "ok" and deadline is None:
                    deadline = time.monotonic() + grace
    except KeyboardInterrupt:
        _kill_all(procs)
        print(f"minddp-train: interrupted; ranks stopped", file=sys.stderr)
        return 130
    stragglers = [r for r in range(nproc) if r not in outcome]
    _kill_all(procs)
    for proc in procs:
        proc.join()
    for conn in conns:
        conn.close()
    return _report(args, outcome, stragglers, grace, last_saved)


def _kill_all(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()


def _report(args, outcome: dict[int, tuple], stragglers: list[int], grace: float, last_saved: int | None) -> int:
    failures = [(rank, msg) for rank, msg in outcome.items() if msg[0] != "ok"]
    if not failures and not stragglers:
        return 0

    def say(text: str) -> None:
        print(f"minddp-train: {text}", file=sys.stderr, flush=True)

    usage = [msg[1] for _, msg in failures if msg[0] == "usage"]
    if usage and all(msg[0] in ("usage", "ok") or (msg[0] == "error" and msg[3]) for _, msg in failures):
        say(f"error: {usage[0]}")  # the same bad input on every rank: one line
        return 2
    # The first failure that is not a communication error is the cause;
    # if every failure is one (a network problem), the earliest is.
    causes = [(rank, msg) for rank, msg in failures if not (msg[0] == "error" and msg[3])] or failures
    first_rank, first = causes[0]
    if first[0] == "died":
        say(f"rank {first_rank} failed first: it {first[1]}")
    elif first[0] == "usage":
        say(f"rank {first_rank} failed first: {first[1]}")
    else:
        say(f"rank {first_rank} failed first:\n{first[1]}")
    others = [(rank, msg) for rank, msg in failures if rank != first_rank]
    if others:
        parts = []
        for rank, msg in others:
            text = {"died": lambda m: m[1], "usage": lambda m: m[1], "error": lambda m: m[2]}[msg[0]](msg)
            parts.append(f"rank {rank}: {text}")
        say("then the others stopped: " + "; ".join(parts))
    if stragglers:
        say(f"rank(s) {', '.join(map(str, stragglers))} had not stopped {grace:.0f} s after that; killed")
    if args.checkpoint_dir and os.path.exists(os.path.join(args.checkpoint_dir, "last.pt")):
        when = f" (step {last_saved})" if last_saved is not None else ""
        say(f"last good checkpoint: {os.path.join(args.checkpoint_dir, 'last.pt')}{when}; continue with --resume")
    return 1
