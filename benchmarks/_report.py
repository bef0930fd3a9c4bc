"""Turning result rows into the table, the JSON file and the picture."""

from __future__ import annotations

import json

FIELDS = [
    "model", "backend", "device", "world_size", "bucket_cap_mb",
    "local_ms", "allreduce_ms", "ideal_ms", "naive_ms", "torch_ddp_ms", "minddp_ms",
    "ratio", "hidden_fraction_torch", "hidden_fraction_minddp",
    "peak_mem_torch_mb", "peak_mem_minddp_mb", "max_param_diff",
]  # fmt: skip

PLOT_INSTALL_HINT = (
    "--plot needs matplotlib, an optional extra: pip install '.[plot]' "
    "(from the checkout) or pip install matplotlib"
)


def make_row(cfg: dict, timed: dict, mem: dict) -> dict:
    """One result row from the timing run's medians and the memory run's peaks."""
    med = timed["median_ms"]
    local, ar = med["local"], med["allreduce"]
    no_overlap = local + ar

    def hidden(t: float) -> float:
        """(no_overlap - t) / allreduce in [0, 1]: 1 = all communication hidden."""
        if ar <= 0:
            return 0.0
        return min(1.0, max(0.0, (no_overlap - t) / ar))

    return {
        "model": timed["model"],
        "backend": cfg["backend"],
        "device": cfg["device"],
        "world_size": cfg["world_size"],
        "bucket_cap_mb": timed["bucket_cap_mb"],
        "local_ms": local,
        "allreduce_ms": ar,
        "ideal_ms": max(local, ar),
        "naive_ms": med["naive"],
        "torch_ddp_ms": med["torch_ddp"],
        "minddp_ms": med["minddp"],
        "ratio": med["minddp"] / med["torch_ddp"],
        "hidden_fraction_torch": hidden(med["torch_ddp"]),
        "hidden_fraction_minddp": hidden(med["minddp"]),
        "peak_mem_torch_mb": mem["torch_ddp"],
        "peak_mem_minddp_mb": mem["minddp"],
        "max_param_diff": timed["max_param_diff"],
    }


def header(cfg: dict) -> str:
    """What each column runs, stated once above the table."""
    view_m = "gradient_as_bucket_view=True" if cfg["minddp_bucket_view"] else "gradient_as_bucket_view=False (copy)"
    view_t = "gradient_as_bucket_view=True" if cfg["torch_bucket_view"] else "gradient_as_bucket_view=False (default)"
    hook = {"none": "no comm hook (built-in all-reduce)", "fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook"}
    return "\n".join(
        [
            f"backend={cfg['backend']} device={cfg['device']} world_size={cfg['world_size']} "
            f"threads/rank={cfg['threads_per_rank']} steps={cfg['steps']} (median of {cfg['repeats']} blocks, "
            f"after {cfg['warmup']} warm-up steps) comm hook: {hook[cfg['comm_hook']]}",
            "  local      every rank: forward + backward + SGD step, no communication",
            "  allreduce  all_reduce of the gradient bytes alone, DDP-like buckets (1 MiB first, then cap)",
            "  ideal      max(local, allreduce): perfect overlap;  no_overlap: local + allreduce",
            "  naive      local step + blocking all_reduce of every .grad after backward",
            f"  torch_ddp  torch.nn.parallel.DistributedDataParallel, {view_t}, {hook[cfg['comm_hook']]}",
            f"  minddp     minddp.MiniDDP, {view_m}, {hook[cfg['comm_hook']]}",
            "  ratio      minddp / torch_ddp;  hidden = (no_overlap - t) / allreduce, clipped to [0, 1]",
            f"  peak mem   MiB added by wrapper + steps ({cfg['memory_method']}), max over ranks",
            "  max diff   largest |param_torch_ddp - param_minddp| after the timed steps (same init, data, steps)",
            "  times: ms per step, median; each block's time is the slowest rank's",
        ]
    )


def table(rows: list[dict]) -> str:
    cols = [
        ("model", "{}", "model"),
        ("cap MB", "{:g}", "bucket_cap_mb"),
        ("local", "{:.1f}", "local_ms"),
        ("allreduce", "{:.1f}", "allreduce_ms"),
        ("ideal", "{:.1f}", "ideal_ms"),
        ("no_overlap", "{:.1f}", None),
        ("naive", "{:.1f}", "naive_ms"),
        ("torch_ddp", "{:.1f}", "torch_ddp_ms"),
        ("minddp", "{:.1f}", "minddp_ms"),
        ("ratio", "{:.3f}", "ratio"),
        ("hidden torch/minddp", None, None),
        ("peak MiB torch/minddp", None, None),
        ("max diff", "{:.1e}", "max_param_diff"),
    ]
    lines = []
    cells_all = []
    for r in rows:
        cells = []
        for title, fmt, key in cols:
            if title == "no_overlap":
                cells.append(fmt.format(r["local_ms"] + r["allreduce_ms"]))
            elif title.startswith("hidden"):
                cells.append(f"{r['hidden_fraction_torch']:.2f} / {r['hidden_fraction_minddp']:.2f}")
            elif title.startswith("peak"):
                cells.append(f"{r['peak_mem_torch_mb']:.1f} / {r['peak_mem_minddp_mb']:.1f}")
            else:
                cells.append(fmt.format(r[key]))
        cells_all.append(cells)
    widths = [max([len(c[0])] + [len(cells[i]) for cells in cells_all]) for i, c in enumerate(cols)]
    lines.append("| " + " | ".join(c[0].ljust(w) for c, w in zip(cols, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for cells in cells_all:
        lines.append("| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |")
    return "\n".join(lines)


def write_json(path: str, cfg: dict, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"config": cfg, "results": [{k: r[k] for k in FIELDS} for r in rows]}, f, indent=2)
        f.write("\n")


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(path: str, cfg: dict, rows: list[dict]) -> None:
    """Bars: step time per model and implementation at the main bucket cap,
    with ideal and no_overlap as lines; beside it, the bucket sweep (if any)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = sorted({r["bucket_cap_mb"] for r in rows})
    main_cap = cfg["bucket_cap_mb"] if cfg["bucket_cap_mb"] in caps else caps[-1]
    main = [r for r in rows if r["bucket_cap_mb"] == main_cap]
    sweep = len(caps) > 1
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(13 if sweep else 7.5, 4.8), squeeze=False)
    ax = axes[0][0]
    impls = [("local_ms", "local"), ("naive_ms", "naive"), ("torch_ddp_ms", "torch DDP"), ("minddp_ms", "MiniDDP")]
    width = 0.8 / len(impls)
    for j, (key, label) in enumerate(impls):
        xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(main))]
        ax.bar(xs, [r[key] for r in main], width, label=label)
    for i, r in enumerate(main):
        ax.hlines(r["ideal_ms"], i - 0.45, i + 0.45, colors="black", linestyles="-", label="ideal" if i == 0 else None)
        ax.hlines(
            r["local_ms"] + r["allreduce_ms"], i - 0.45, i + 0.45, colors="red", linestyles="--",
            label="no overlap" if i == 0 else None,
        )  # fmt: skip
    ax.set_xticks(range(len(main)))
    ax.set_xticklabels([r["model"] for r in main])
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"{cfg['backend']}/{cfg['device']}, {cfg['world_size']} ranks, bucket cap {main_cap:g} MB")
    ax.legend(fontsize=8)
    if sweep:
        ax = axes[0][1]
        for model in dict.fromkeys(r["model"] for r in rows):
            rs = sorted((r for r in rows if r["model"] == model), key=lambda r: r["bucket_cap_mb"])
            x = [r["bucket_cap_mb"] for r in rs]
            (line,) = ax.plot(x, [r["torch_ddp_ms"] for r in rs], "o--", label=f"{model} torch DDP")
            ax.plot(x, [r["minddp_ms"] for r in rs], "s-", color=line.get_color(), label=f"{model} MiniDDP")
        ax.set_xscale("log")
        ax.set_xticks(caps)
        ax.set_xticklabels([f"{c:g}" for c in caps])
        ax.minorticks_off()
        ax.set_xlabel("bucket cap (MB)")
        ax.set_ylabel("ms per step (median)")
        ax.set_title("bucket sweep")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
