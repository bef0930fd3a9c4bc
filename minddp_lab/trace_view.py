"""Reading MiniDDP's Chrome trace back, and drawing which all-reduces hid under backward.

The trace (``minddp/ddp/observers/trace.py``, ``MiniDDP(..., trace=True)``) is a list of
Chrome trace events. Per rank (``pid``) there are two tracks (``tid``):

* backward (tid 0): an instant event (``"ph": "i"``) named ``grad NAME``
  each time a gradient hook fired, and one complete event (``"ph": "X"``,
  start ``ts`` and length ``dur``, in microseconds) per step, from the first
  hook until every ``.grad`` held the average;
  The forward of each synchronized step is a complete event ``forward``,
  and each hook's event carries its gradient's ``bytes`` and ``dtype``;
* communication (tid 1): one complete event ``all_reduce bucket K`` per
  bucket, from its launch until its all-reduce completed.

:func:`read_steps` groups them into one :class:`StepView` per rank and step.
Every event carries the ``step`` it belongs to (a bucket's bar: the step it
was launched in).

A trace of a module on a GPU holds device times (CUDA events; its
``otherData.clock`` says ``"cuda events"``), one on CPU ``perf_counter``
times; the picture's axis says which.

Used by ``benchmarks/compare.py --trace`` and by lesson 16. matplotlib is
imported only inside :func:`draw_overlap` (it is the optional ``plot`` extra).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from minddp.ddp.observers.trace import BACKWARD_TRACK, COMM_TRACK


@dataclass
class BucketBar:
    index: int
    launched_ms: float
    finished_ms: float
    nbytes: int


@dataclass
class StepView:
    """One rank's step; times in ms on the machine's shared ``perf_counter`` clock."""

    rank: int
    step: int
    start_ms: float  # first gradient hook
    end_ms: float  # every .grad written
    hooks: list[tuple[str, float]] = field(default_factory=list)  # (parameter name, when), in firing order
    hook_bytes: list[int] = field(default_factory=list)  # each hook's gradient size, same order as hooks
    forward_ms: float | None = None  # the forward of this step, when the trace has it
    buckets: list[BucketBar] = field(default_factory=list)  # in launch order

    @property
    def last_hook_ms(self) -> float:
        return self.hooks[-1][1] if self.hooks else self.start_ms

    def launched_before_last_hook(self) -> int:
        return sum(1 for b in self.buckets if b.launched_ms < self.last_hook_ms)

    def finished_before_last_hook(self) -> int:
        """Buckets whose all-reduce was over before backward computed its last gradient: fully hidden."""
        return sum(1 for b in self.buckets if b.finished_ms <= self.last_hook_ms)

    def summary(self) -> str:
        return (
            f"rank {self.rank}, step {self.step}: {len(self.buckets)} bucket{'s' * (len(self.buckets) != 1)}, "
            f"{self.launched_before_last_hook()} launched and {self.finished_before_last_hook()} finished before "
            f"the last gradient hook; gradients took {self.last_hook_ms - self.start_ms:.1f} ms from the first "
            f"hook, then {self.end_ms - self.last_hook_ms:.1f} ms waiting for communication"
        )


def read_steps(trace: dict) -> dict[int, list[StepView]]:
    """rank -> its steps in order, from a trace dict (``json.load`` of the exported file)."""
    events = trace["traceEvents"]
    views: dict[tuple[int, int], StepView] = {}
    for e in events:
        if e.get("tid") == BACKWARD_TRACK and e["ph"] == "X" and e["name"].startswith("backward"):
            key = (e["pid"], e["args"]["step"])
            views[key] = StepView(e["pid"], e["args"]["step"], e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3)
    for e in sorted(events, key=lambda e: e.get("ts", 0.0)):
        if e.get("tid") == BACKWARD_TRACK and e["ph"] == "i" and (e["pid"], e["args"]["step"]) in views:
            view = views[(e["pid"], e["args"]["step"])]
            view.hooks.append((e["name"].removeprefix("grad "), e["ts"] / 1e3))
            view.hook_bytes.append(e["args"].get("bytes", 0))
        elif e.get("tid") == BACKWARD_TRACK and e["ph"] == "X" and e["name"] == "forward":
            if (e["pid"], e["args"]["step"]) in views:
                views[(e["pid"], e["args"]["step"])].forward_ms = e["dur"] / 1e3
        elif e.get("tid") == COMM_TRACK and e["ph"] == "X":
            owner = views.get((e["pid"], e["args"]["step"]))
            if owner is not None:  # a bar of a step whose backward is not in the trace is dropped
                launched = e["ts"] / 1e3
                index = int(re.search(r"(\d+)$", e["name"]).group(1))
                owner.buckets.append(BucketBar(index, launched, launched + e["dur"] / 1e3, e["args"]["bytes"]))
    by_rank: dict[int, list[StepView]] = {}
    for (rank, step) in sorted(views):
        by_rank.setdefault(rank, []).append(views[(rank, step)])
    return by_rank


def draw_overlap(trace: dict, path: str, title: str = "", step_position: int = -1) -> None:
    """PNG of one step (default the last) on every rank: a backward track and a communication track.

    Backward: dark while gradients are being computed (first to last hook,
    a tick per hook), light while waiting for communication afterwards.
    Communication: one bar per bucket, launch to completion, green where it
    ran under backward (before the last hook), red where it stuck out.
    Time 0 is the earliest first hook of that step over all ranks.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = {rank: views[step_position] for rank, views in read_steps(trace).items()}
    t0 = min(v.start_ms for v in steps.values())
    rows = sum(1 + max(1, len(v.buckets)) for v in steps.values())
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.28 * rows))
    y, ticks, labels = 0.0, [], []
    for rank, v in sorted(steps.items()):
        top, last = y, v.last_hook_ms - t0
        ax.broken_barh([(v.start_ms - t0, last - (v.start_ms - t0))], (y - 0.4, 0.8), color="0.35")
        ax.broken_barh([(last, v.end_ms - v.last_hook_ms)], (y - 0.4, 0.8), color="0.8")
        ax.vlines([t - t0 for _, t in v.hooks], y - 0.45, y + 0.45, colors="black", linewidth=0.6)
        ticks.append(y)
        labels.append(f"rank {rank} backward")
        for bar in v.buckets:
            y += 1
            start, end = bar.launched_ms - t0, bar.finished_ms - t0
            hidden_end = min(end, last)
            if hidden_end > start:
                ax.broken_barh([(start, hidden_end - start)], (y - 0.35, 0.7), color="tab:green")
            if end > max(start, last):
                ax.broken_barh([(max(start, last), end - max(start, last))], (y - 0.35, 0.7), color="tab:red")
            ticks.append(y)
            labels.append(f"rank {rank} bucket {bar.index} ({bar.nbytes / 2**20:.2f} MiB)")
        ax.vlines(last, top - 0.5, y + 0.5, colors="0.4", linestyles=":", linewidth=0.8)  # this rank's last hook
        y += 1.6
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    clock = trace.get("otherData", {}).get("clock", "perf_counter")
    where = "GPU time, CUDA events" if clock == "cuda events" else "CPU time"
    ax.set_xlabel(f"ms since the first gradient hook of the step ({where})")
    step_no = next(iter(steps.values())).step
    ax.set_title(
        (title + "\n" if title else "")
        + f"step {step_no}: dark = computing gradients (ticks: hooks), light = waiting; "
        "all-reduce green = under backward, red = after the last hook",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
