"""Sweeps, the text table and the two pictures of the simulator.

matplotlib (the optional ``plot`` extra) is imported only inside the
``draw_*`` functions; :func:`have_matplotlib` lets a caller say so first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minddp.net.network import Hierarchy, Link
from minddp.simulate.profile import ComputeProfile
from minddp.simulate.replay import DDPPolicy, SimulatedStep, simulate_step

__all__ = ["Row", "sweep", "format_table", "have_matplotlib", "draw_scaling", "draw_timeline"]


@dataclass
class Row:
    world_size: int
    bucket_cap_mb: float
    step: SimulatedStep


def sweep(profile: ComputeProfile, network: Link | Hierarchy, worlds: list[int], caps_mb: list[float],
          policy: DDPPolicy = DDPPolicy()) -> list[Row]:
    """One simulated step per (bucket cap, world size), caps outermost."""
    return [Row(p, cap, simulate_step(profile, network, p, replace(policy, bucket_cap_mb=cap)))
            for cap in caps_mb for p in worlds]


def format_table(rows: list[Row]) -> str:
    """A markdown table, times in ms per optimizer step.

    compute: the step without DDP; hooks: gradient hooks and bucket launches added to backward;
    contention: backward's time lost to collectives beside it; per step: the wrapper's own cost.
    """
    lines = [
        "| world | cap MB | buckets | step ms | compute ms | comm ms | exposed ms | hidden | hooks ms "
        "| contention ms | per step ms | efficiency |",
        "|------:|-------:|--------:|--------:|-----------:|--------:|-----------:|-------:|---------:"
        "|--------------:|------------:|-----------:|",
    ]
    for r in rows:
        s = r.step
        lines.append(f"| {r.world_size} | {r.bucket_cap_mb:g} | {len(s.buckets)} | {s.step_ms:.2f} | "
                     f"{s.compute_ms:.2f} | {s.comm_ms:.2f} | {s.exposed_ms:.2f} | {s.hidden_fraction:.2f} | "
                     f"{s.hooks_ms:.2f} | {s.contention_ms:.2f} | {s.per_step_ms:.2f} | {s.scaling_efficiency:.1%} |")
    return "\n".join(lines)


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_scaling(rows: list[Row], path: str, title: str = "") -> None:
    """PNG: step time and scaling efficiency against world size, one line per bucket cap."""
    plt = _pyplot()
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
    for cap in dict.fromkeys(r.bucket_cap_mb for r in rows):
        mine = [r for r in rows if r.bucket_cap_mb == cap]
        worlds = [r.world_size for r in mine]
        ax_t.plot(worlds, [r.step.step_ms for r in mine], marker="o", label=f"{cap:g} MB buckets")
        ax_e.plot(worlds, [100 * r.step.scaling_efficiency for r in mine], marker="o", label=f"{cap:g} MB buckets")
    for ax, label in ((ax_t, "simulated step time (ms)"), (ax_e, "scaling efficiency (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_e.set_ylim(0, 105)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_timeline(step: SimulatedStep, path: str, title: str = "") -> None:
    """PNG of one simulated step, drawn like :func:`minddp.ddp.observers.trace_view.draw_overlap`.

    Backward: dark until its last gradient, light while waiting for the
    all-reduces. One bar per bucket, ready (tick) to launch to completion:
    green under backward, red after its last gradient.
    """
    plt = _pyplot()
    rows = 1 + len(step.buckets)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.28 * rows))
    last = step.backward_end_ms
    ax.broken_barh([(0, last)], (-0.4, 0.8), color="0.35")
    if step.comm_end_ms > last:
        ax.broken_barh([(last, step.comm_end_ms - last)], (-0.4, 0.8), color="0.8")
    ticks, labels = [0], ["backward"]
    for y, b in enumerate(step.buckets, start=1):
        hidden_end = min(b.end_ms, last)
        if hidden_end > b.start_ms:
            ax.broken_barh([(b.start_ms, hidden_end - b.start_ms)], (y - 0.35, 0.7), color="tab:green")
        if b.end_ms > max(b.start_ms, last):
            ax.broken_barh([(max(b.start_ms, last), b.end_ms - max(b.start_ms, last))], (y - 0.35, 0.7),
                           color="tab:red")
        ax.vlines(b.ready_ms, y - 0.45, y + 0.45, colors="black", linewidth=0.8)
        ticks.append(y)
        labels.append(f"bucket {b.index} ({b.nbytes / 2**20:.2f} MiB)")
    ax.vlines(last, -0.5, rows - 0.5, colors="0.4", linestyles=":", linewidth=0.8)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms since backward began (simulated)")
    ax.set_title((title + "\n" if title else "") + f"world size {step.world_size}: dark = backward, light = waiting; "
                 "all-reduce green = under backward, red = after the last gradient (tick: bucket ready)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
