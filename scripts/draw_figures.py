"""Draw the glossary's two pictures into docs/figures/ (needs matplotlib).

    python scripts/draw_figures.py [--out docs/figures]

bucket_life.png     one backward pass of a 6-layer model with 3 buckets: when each
                    bucket fills, is launched, is reduced, and is written to .grad.
ring_allreduce.png  the ring all-reduce over 4 ranks, step by step: 3 steps of
                    reduce-scatter, then 3 of all-gather (as lesson 03 runs it).

Both are drawn from the rules they illustrate (the ring's send and receive
indices are lesson 03's), not from hand-placed boxes.
"""

from __future__ import annotations

import argparse
import pathlib

# Backward computes the last layer's gradient first. Durations in arbitrary time units.
LAYER_TIMES = [("layer 6", 1.0), ("layer 5", 1.0), ("layer 4", 1.2), ("layer 3", 1.2), ("layer 2", 1.2), ("layer 1", 1.4)]
BUCKETS = [["layer 6", "layer 5"], ["layer 4", "layer 3"], ["layer 2", "layer 1"]]
ALLREDUCE_TIME = 2.0  # one bucket's all-reduce; one at a time on the wire
COPY_TIME = 0.5  # writing every average into .grad at the end


def bucket_schedule(allreduce_time: float = ALLREDUCE_TIME) -> tuple[dict[str, tuple[float, float]], list[dict[str, float]], float, float]:
    """When each layer's gradient is computed, and each bucket's fill, launch and finish times."""
    layers, t = {}, 0.0
    for name, duration in LAYER_TIMES:
        layers[name] = (t, t + duration)
        t += duration
    backward_end = t
    buckets, wire_free = [], 0.0
    for members in BUCKETS:
        first_grad = min(layers[m][1] for m in members)
        full = max(layers[m][1] for m in members)
        launched = max(full, wire_free)  # strictly in bucket order, one on the wire at a time
        reduced = launched + allreduce_time
        wire_free = reduced
        buckets.append({"first": first_grad, "full": full, "launched": launched, "reduced": reduced})
    written = max(backward_end, wire_free) + COPY_TIME
    return layers, buckets, backward_end, written


def draw_bucket_life(path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    layers, buckets, backward_end, written = bucket_schedule()
    colours = {"compute": "#9ecae1", "filling": "#fdd0a2", "wire": "#e6550d", "reduced": "#c7e9c0", "grad": "#31a354"}
    fig, ax = plt.subplots(figsize=(10, 3.6))
    rows = ["backward"] + [f"bucket {i}" for i in range(len(buckets))]
    y = {name: len(rows) - 1 - i for i, name in enumerate(rows)}
    for name, (start, end) in layers.items():
        ax.barh(y["backward"], end - start, left=start, color=colours["compute"], edgecolor="white")
        ax.text((start + end) / 2, y["backward"], f"grad of\n{name}", ha="center", va="center", fontsize=7)
    wait_start = backward_end
    for i, b in enumerate(buckets):
        row = y[f"bucket {i}"]
        ax.barh(row, b["full"] - b["first"] + 0.05, left=b["first"] - 0.05, color=colours["filling"], edgecolor="grey")
        ax.barh(row, b["reduced"] - b["launched"], left=b["launched"], color=colours["wire"], edgecolor="grey")
        ax.barh(row, written - COPY_TIME - b["reduced"], left=b["reduced"], color=colours["reduced"], edgecolor="grey")
        ax.barh(row, COPY_TIME, left=written - COPY_TIME, color=colours["grad"], edgecolor="grey")
        ax.plot([b["launched"]], [row + 0.42], marker="v", color="black", markersize=5)
        ax.text(b["launched"] + 0.08, row + 0.42, "launched", fontsize=7, va="center")
    ax.axvline(backward_end, color="black", linestyle="--", linewidth=1)
    ax.text(backward_end - 0.08, -0.95, "end of backward:\nwait for every bucket", fontsize=7, ha="right", va="bottom")
    ax.axvline(written, color="black", linewidth=1)
    ax.text(written + 0.08, -0.95, "optimizer\n.step()", fontsize=7, va="bottom")
    ax.annotate("", xy=(written - COPY_TIME, -0.65), xytext=(wait_start, -0.65),
                arrowprops={"arrowstyle": "<->", "linewidth": 0.8})
    ax.text((wait_start + written - COPY_TIME) / 2, -0.75, "not hidden\nunder backward", fontsize=7, ha="center", va="top")
    ax.set_yticks([y[r] for r in rows], rows)
    ax.set_ylim(-1.3, len(rows) - 0.4)
    ax.set_xlim(0, written + 1.0)
    ax.set_xlabel("time during one step (arbitrary units)")
    ax.set_title("A bucket's life: filling, launched, reduced, written to .grad")
    ax.legend(handles=[Patch(color=colours["compute"], label="backward computes a gradient"),
                       Patch(color=colours["filling"], label="filling (hooks copy gradients in)"),
                       Patch(color=colours["wire"], label="all-reduce on the wire"),
                       Patch(color=colours["reduced"], label="reduced, waiting for the end"),
                       Patch(color=colours["grad"], label="written to .grad")],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ring_states(world_size: int = 4) -> list[tuple[str, list[list[frozenset[int]]], list[tuple[int, int]]]]:
    """Each rank's chunks after every step: the set of ranks whose data each chunk sums.

    Returns (title, held[rank][chunk], moves) per step, moves = (sending rank, chunk index)."""
    p = world_size
    held = [[frozenset([r]) for _ in range(p)] for r in range(p)]
    states = [("start: each rank's own data", [row[:] for row in held], [])]
    for step in range(p - 1):  # reduce-scatter: receive a partial sum, add your own
        sent = [(r, (r - step) % p) for r in range(p)]
        incoming = {((r + 1) % p, c): held[r][c] for r, c in sent}
        for (r, c), chunk in incoming.items():
            held[r][c] = held[r][c] | chunk
        states.append((f"reduce-scatter step {step + 1}", [row[:] for row in held], sent))
    for step in range(p - 1):  # all-gather: pass the finished sums on round the ring
        sent = [(r, (r + 1 - step) % p) for r in range(p)]
        incoming = {((r + 1) % p, c): held[r][c] for r, c in sent}
        for (r, c), chunk in incoming.items():
            held[r][c] = chunk
        states.append((f"all-gather step {step + 1}", [row[:] for row in held], sent))
    return states


def draw_ring_allreduce(path: pathlib.Path, world_size: int = 4) -> None:
    import matplotlib.pyplot as plt

    states = ring_states(world_size)
    p = world_size
    steps = p - 1
    fig, grid = plt.subplots(2, 1 + steps, figsize=(2.1 * (1 + steps), 5.2))
    axes = [grid[0][0], *grid[0][1:], *grid[1][1:]]  # start, reduce-scatter steps, all-gather steps
    note = grid[1][0]
    note.axis("off")
    note.text(0.0, 0.5, f"After reduce-scatter,\nrank r holds the whole\nsum of chunk r+1\n(mod {p}).\n\nAll-gather passes\nthose sums on round\nthe ring: {steps} more\nsteps, and every rank\nholds every sum.\n\nEach rank sends\n2 x {steps}/{p} of its\ngradient's bytes.",
              fontsize=7, va="center")
    cmap = plt.get_cmap("Blues")
    for ax, (title, held, sent) in zip(axes, states):
        sent_cells = set(sent)
        for r in range(p):
            for c in range(p):
                n = len(held[r][c])
                ax.add_patch(plt.Rectangle((c, p - 1 - r), 1, 1, facecolor=cmap(0.15 + 0.75 * n / p),
                                           edgecolor="red" if (r, c) in sent_cells else "white",
                                           linewidth=2 if (r, c) in sent_cells else 1))
                label = "all" if n == p else "+".join(str(k) for k in sorted(held[r][c]))
                ax.text(c + 0.5, p - 0.5 - r, label, ha="center", va="center", fontsize=6,
                        color="white" if n >= p - 1 else "black")
        ax.set_xlim(0, p)
        ax.set_ylim(0, p)
        ax.set_aspect("equal")
        ax.set_xticks([c + 0.5 for c in range(p)], [f"c{c}" for c in range(p)], fontsize=7)
        ax.set_yticks([p - 0.5 - r for r in range(p)], [f"rank {r}" for r in range(p)], fontsize=7)
        ax.tick_params(length=0)
        ax.set_title(title, fontsize=7, wrap=True)
    fig.suptitle(f"Ring all-reduce over {p} ranks, each rank's gradient cut in {p} chunks c0..c{p - 1}.\n"
                 "A cell: whose data that chunk sums on that rank. Red: the chunk the rank sent to rank+1 this step.",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[pathlib.Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent.parent / "docs" / "figures"),
                        help="folder to write the pictures into (default: docs/figures)")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        raise SystemExit("draw_figures needs matplotlib: pip install matplotlib (or the project's [plot] extra)")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "bucket_life.png", out / "ring_allreduce.png"]
    draw_bucket_life(written[0])
    draw_ring_allreduce(written[1])
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
