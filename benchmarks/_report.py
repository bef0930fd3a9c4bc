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


LEARNED_ORDER_FIELDS = [
    "model", "bucket_cap_mb", "local_ms", "allreduce_ms", "learned_ms", "registration_ms", "ratio",
    "hidden_fraction_learned", "hidden_fraction_registration", "buckets_learned", "buckets_registration",
    "launched_before_last_hook_learned", "launched_before_last_hook_registration",
]  # fmt: skip


def hidden_fraction(local: float, allreduce: float, t: float) -> float:
    """(local + allreduce - t) / allreduce in [0, 1]: 1 = all communication hidden."""
    if allreduce <= 0:
        return 0.0
    return min(1.0, max(0.0, (local + allreduce - t) / allreduce))


def make_row(cfg: dict, timed: dict, mem: dict) -> dict:
    """One result row from the timing run's medians and the memory run's peaks."""
    med = timed["median_ms"]
    local, ar = med["local"], med["allreduce"]

    def hidden(t: float) -> float:
        return hidden_fraction(local, ar, t)

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
    return markdown_table([c[0] for c in cols], cells_all)


def markdown_table(titles: list[str], cells_all: list[list[str]]) -> str:
    """A Markdown table, first column left-aligned, the others right-aligned."""
    widths = [max([len(t)] + [len(cells[i]) for cells in cells_all]) for i, t in enumerate(titles)]
    lines = ["| " + " | ".join(t.ljust(w) for t, w in zip(titles, widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for cells in cells_all:
        lines.append("| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |")
    return "\n".join(lines)


def make_learned_order_row(timed: dict) -> dict:
    """One ``--learned-order`` row from the medians and bucket counts of ``_overlap.measure_learned_order``."""
    med = timed["median_ms"]
    local, ar = med["local"], med["allreduce"]
    row = {"model": timed["model"], "bucket_cap_mb": timed["bucket_cap_mb"], "local_ms": local, "allreduce_ms": ar}
    for name in ("learned", "registration"):
        row[f"{name}_ms"] = med[name]
        row[f"hidden_fraction_{name}"] = hidden_fraction(local, ar, med[name])
        row[f"buckets_{name}"] = timed[f"buckets_{name}"]
        row[f"launched_before_last_hook_{name}"] = timed[f"launched_before_last_hook_{name}"]
    row["ratio"] = med["learned"] / med["registration"]
    return {k: row[k] for k in LEARNED_ORDER_FIELDS}


def learned_order_text(rows: list[dict]) -> str:
    """The ``--learned-order`` table, with what its columns mean."""
    lines = [
        "MiniDDP bucket order on shuffled_mlp (layers registered in a different order than they run):",
        "  learned       learn_bucket_order=True: buckets rebuilt after step 1 in the order gradients arrived",
        "  registration  learn_bucket_order=False: buckets in reverse registration order (a wrong guess here)",
        "  early         buckets launched before the last gradient hook / buckets (rank 0, last step)",
        "  times: ms per step, median, slowest rank; hidden as in the table above",
    ]
    titles = ["model", "cap MB", "local", "allreduce", "learned", "registration", "learned/registration",
              "hidden learned/registration", "early learned", "early registration"]  # fmt: skip
    cells_all = [
        [
            r["model"], f"{r['bucket_cap_mb']:g}", f"{r['local_ms']:.1f}", f"{r['allreduce_ms']:.1f}",
            f"{r['learned_ms']:.1f}", f"{r['registration_ms']:.1f}", f"{r['ratio']:.3f}",
            f"{r['hidden_fraction_learned']:.2f} / {r['hidden_fraction_registration']:.2f}",
            f"{r['launched_before_last_hook_learned']} / {r['buckets_learned']}",
            f"{r['launched_before_last_hook_registration']} / {r['buckets_registration']}",
        ]  # fmt: skip
        for r in rows
    ]
    return "\n".join(lines) + "\n" + markdown_table(titles, cells_all)


def write_json(path: str, cfg: dict, rows: list[dict], learned_order: list[dict] | None = None) -> None:
    """``{"config", "results"}``, plus ``"learned_order"`` when it was measured (an added key only)."""
    data = {"config": cfg, "results": [{k: r[k] for k in FIELDS} for r in rows]}
    if learned_order:
        data["learned_order"] = learned_order
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
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
