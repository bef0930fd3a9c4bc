"""Peak memory of one implementation's training steps, measured fairly.

On GPU this is easy: ``torch.cuda.reset_peak_memory_stats()`` opens a fresh
window and ``max_memory_allocated()`` closes it.

On CPU the obvious tool, ``resource.getrusage().ru_maxrss``, is *monotonic*:
the process's high-water mark only ever goes up, so whichever implementation
is measured second in a process is hidden under the first one's peak. And
even the current RSS lies after a free, because glibc's malloc keeps freed
memory in its heap, where the next implementation reuses it without the
kernel ever seeing new pages.

So, on Linux with glibc, memory is measured in processes of its own, started
after the timing run, with ``MALLOC_MMAP_THRESHOLD_=65536`` in their
environment (:data:`ALLOCATOR_ENV`): every large block (gradients, buckets,
activations) is then its own mapping, resident while alive and unmapped when
freed, so RSS follows live tensors rather than the heap's history. (This
changes allocation costs, which is why no step is timed in those processes.
Measured in the timing processes instead, with their heap full of freed
blocks, repeated windows of one implementation differed by up to 40% and
the order of measurement decided which wrapper looked smaller; with it they
agree to within 1%.) Each window:

1. ``gc.collect()`` and ``malloc_trim(0)``: free heap pages go back to the
   kernel, so memory the next implementation touches shows up as new
   resident pages;
2. write ``5`` to ``/proc/self/clear_refs``: the kernel resets this
   process's peak RSS (``VmHWM``) to its current RSS;
3. baseline = ``VmRSS``; run; report ``VmHWM - baseline``.

Both implementations are measured this way in the same processes, in fresh
windows, after the same model, optimizer and data already exist (they sit in
the baseline). Before a model's first measured window, an unmeasured one
takes the one-off costs (code pages touched, lazy initialisation: without it
the first window of the CNN read 70 MiB against 43 for the next ones). What lands in a window is what the wrapper
adds: its buckets, the gradients, its construction-time copies, and
activations (equal for both). Where ``clear_refs`` cannot be written (not
Linux, a locked-down container) the window falls back to current RSS sampled
after every step, which misses short-lived peaks inside a step; the method
used is reported.

One thing lands in a window that neither wrapper allocates: Gloo's own
scratch memory while an all-reduce is on its thread (C++, no tensor), when
that all-reduce happens to run at the moment backward's activations peak.
It is a race, and it only adds: on the mlp with bucket views, 16 windows of
each wrapper read 49.0 to 49.5 MiB in some and 49.9 to 50.2 in others (1 to
8 of 16), for torch's DDP and MiniDDP alike, and with a hook that
communicates nothing 49.0 to 49.2 in all of them. So each wrapper's window
is opened several times, the wrappers taking turns (:func:`peak_windows`),
and the lowest reading is its peak; the JSON keeps every reading.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Callable

import torch

MB = 1024 * 1024

# glibc reads this at start-up; set in the memory run's environment only.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}

_libc = None


def _malloc_trim() -> None:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
        except OSError:
            _libc = False
    if _libc:
        try:
            _libc.malloc_trim(0)
        except AttributeError:  # not glibc
            pass


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_method() -> str:
    """Which CPU method this process can use (decided once, reported in the JSON)."""
    if _status_kb("VmRSS") is not None and _reset_hwm():
        return "VmHWM-window"  # clear_refs + VmHWM - VmRSS, after malloc_trim
    return "rss-sampled"


def method(device: torch.device) -> str:
    """How peak memory is measured on ``device`` (reported in the JSON config)."""
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated-window"
    return cpu_method()


def peak_delta_mb(run: Callable[[Callable[[], None]], None], device: torch.device) -> float:
    """Peak memory added while ``run(after_step)`` executes, in MiB.

    ``run`` builds the wrapper and performs its steps, calling ``after_step()``
    after each one (used only by the sampled fallback).
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run(lambda: None)
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / MB

    _malloc_trim()
    if cpu_method() == "VmHWM-window":  # cpu_method() also opened the window
        base = _status_kb("VmRSS")
        run(lambda: None)
        return max(0, _status_kb("VmHWM") - base) / 1024

    base = _status_kb("VmRSS")
    if base is None:  # no /proc: the monotonic ru_maxrss is all there is
        import resource

        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run(lambda: None)
        return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    peak = [base]

    def sample() -> None:
        peak[0] = max(peak[0], _status_kb("VmRSS"))

    run(sample)
    return max(0, peak[0] - base) / 1024


def peak_windows(measure: Callable[[str], float], names: list[str], windows: int) -> dict[str, list[float]]:
    """``windows`` readings of ``measure(name)`` for each name, the names taking turns."""
    readings: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(windows):
        for name in names:
            readings[name].append(measure(name))
    return readings


def lowest(readings: dict[str, list[float]]) -> dict[str, float]:
    """Each name's peak: its lowest reading (what lands only sometimes is not the wrapper's)."""
    return {name: min(values) for name, values in readings.items()}


def release() -> None:
    """Drop what the last window left behind before the next one opens."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    _malloc_trim()


__all__ = ["peak_delta_mb", "peak_windows", "lowest", "cpu_method", "method", "release", "ALLOCATOR_ENV", "MB"]
