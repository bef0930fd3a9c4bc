"""What can go wrong in ``minddp-train``, and how to say it in one line.

Two kinds of failure are told apart: bad input (:class:`UsageError`, and
:class:`~minddp_lab.train.checkpoint.CheckpointError` for a checkpoint that does
not fit), reported as one line with exit code 2; and a rank that failed,
reported with its traceback, exit code 1. When one rank fails, its peers fail
a moment later with communication errors; :func:`is_communication_error`
recognises those echoes so that the cause is the one shown in full.
"""

from __future__ import annotations

import re

import torch.distributed as dist

__all__ = ["UsageError", "is_communication_error", "describe_exception"]


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


_COMM_PATTERN = re.compile(
    r"gloo|nccl|connection (closed|reset|refused)|broken pipe|timed out|timeout|peer|socket|"
    r"process group|ProcessGroup|store|abort",
    re.IGNORECASE,
)
# Raised through NCCL (as a DistBackendError), yet this rank's own failure:
# NCCL's own error codes for a bad call or a failed CUDA call here, and CUDA's
# errors. A peer's death reads otherwise (ncclRemoteError, ncclSystemError,
# "aborted", the watchdog's timeout).
_OWN_ERROR_PATTERN = re.compile(
    r"ncclUnhandledCudaError|ncclInvalidUsage|ncclInvalidArgument|ncclInternalError|CUDA error|"
    r"CUDA out of memory|illegal memory access|device-side assert",
    re.IGNORECASE,
)


def is_communication_error(exc: BaseException) -> bool:
    """Does ``exc`` look like the consequence of another rank failing (not a bug on this rank)?"""
    if _OWN_ERROR_PATTERN.search(str(exc)):
        return False
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
