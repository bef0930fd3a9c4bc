"""Turning result rows into the table, the JSON file and the picture."""

from __future__ import annotations

import json

from benchlib import prediction
from benchlib.bound import RULES
from benchlib.spread import hidden_fraction
from benchlib.tables import markdown_table, with_spread

PLOT_INSTALL_HINT = (
    "--plot needs matplotlib, an optional extra: pip install '.[plot]' "
    "(from the checkout) or pip install matplotlib"
)


LEARNED_ORDER_FIELDS = [
    "model", "bucket_cap_mb", "local_ms", "allreduce_ms", "learned_ms", "registration_ms", "ratio",
    "hidden_fraction_learned", "hidden_fraction_registration", "buckets_learned", "buckets_registration",
    "launched_before_last_hook_learned", "launched_before_last_hook_registration",
]  # fmt: skip


def _has_bound(rows: list[dict]) -> bool:
    """Rows measured with the flat all-reduce (JSON files written before it have no bound)."""
    return bool(rows) and all("bound_ms" in r for r in rows)


def _bound_line(cfg: dict) -> list[str]:
    if "bound_rule" not in cfg:
        return []
    why = {"sum": "no core to spare per rank, so communication cannot overlap compute",
           "max": "a core to spare per rank, a GPU or a real link: the all-reduce can hide under backward and the "
                  "step, never under forward"}[cfg["bound_rule"]]  # fmt: skip
    parts = {"sum": "the bare step (local)", "max": "forward alone, the bare step (local)"}[cfg["bound_rule"]]
    return [f"  bound      {RULES[cfg['bound_rule']]}, from {parts} and one all_reduce of every gradient in one flat "
            f"buffer, timed in the same rounds ({why})"]


def header(cfg: dict) -> str:
    """What each column runs, stated once above the tables."""
    hook = {"none": "no comm hook (built-in all-reduce)", "fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook",
            "allreduce": "allreduce_hook on both wrappers (at world size 1 both then communicate)"}
    return "\n".join(
        [
            f"backend={cfg['backend']} device={cfg['device']} world_size={cfg['world_size']} "
            f"threads/rank={cfg['threads_per_rank']}; {cfg['runs']} run(s) in fresh processes, each "
            f"{cfg['repeats']} rounds of {cfg['steps'] // cfg['repeats']} steps per implementation after "
            f"{cfg['warmup']} warm-up steps; comm hook: {hook[cfg['comm_hook']]}; "
            f"link: {cfg.get('link', 'loopback')}",
            "  local      every rank: forward + backward + SGD step, no communication",
            "  allreduce  all_reduce of the gradient bytes alone, in the wrappers' buckets",
            "  ideal      max(local, allreduce): perfect overlap",
            *_bound_line(cfg),
            "  naive      local step + blocking all_reduce of every .grad after backward",
            "  torch      torch.nn.parallel.DistributedDataParallel;  minddp  minddp.MiniDDP",
            "  cap MB     25: both wrappers at their default, no cap given (25 MiB, the first bucket 1 MiB); another cap",
            "             is given to both, and then their first bucket is that cap too (torch's rule, MiniDDP's as well)",
            "  copy/view  gradient_as_bucket_view=False (both wrappers' default) / True",
            "  ratio      minddp / torch, same setting; within a run, then the median [min, max] over runs",
            "  auto       plan_buckets(MiniDDP(buffer_sync='with_gradients')) (buckets: as many as it chose); ratio auto: auto / torch copy",
            "  max diff   largest |param_torch - param_minddp| after the timed steps (same init, data, steps)",
            "  times: ms per step, the run's median over rounds (each block: the slowest rank), median over runs",
        ]
    )


def table(rows: list[dict], views: list[str]) -> str:
    """Step times with communication, and the ratios with their spread."""
    bound = _has_bound(rows)
    titles = ["model", "cap MB", "local", "allreduce", "ideal"] + ([f"bound ({rows[0]['bound_rule']})"] if bound else [])
    titles.append("naive")
    for v in views:
        titles += [f"torch {v}", f"minddp {v}", f"ratio {v}"]
    auto = all("ratio_auto" in r for r in rows)
    if auto:
        titles += ["minddp auto (buckets)", "ratio auto"]
    titles.append("max diff")
    cells_all = []
    for r in rows:
        keys = ("local_ms", "allreduce_ms", "ideal_ms") + (("bound_ms",) if bound else ()) + ("naive_ms",)
        cells = [r["model"], f"{r['bucket_cap_mb']:g}"] + [f"{r[k]:.1f}" for k in keys]
        for v in views:
            cells += [f"{r[f'torch_{v}_ms']:.1f}", f"{r[f'minddp_{v}_ms']:.1f}", with_spread(r, f"ratio_{v}", "{:.3f}")]
        if auto:
            cells += [f"{r['minddp_auto_ms']:.1f} ({r['auto_buckets']:g})", with_spread(r, "ratio_auto", "{:.3f}")]
        diff = f"{r['max_param_diff']:.1e}"
        cells.append(diff + (f" (auto {r['max_param_diff_auto']:.1e})" if auto else ""))
        cells_all.append(cells)
    return markdown_table(titles, cells_all)


OVERHEAD_TEXT = [
    "Wrapper overhead: each wrapper with a comm hook that returns its bucket at once (no communication);",
    "  overhead = (its step - the bare model's step of the same round), median over rounds, in ms and as a",
    "  fraction of the bare step (local); minddp - torch: the same pairing between the two wrappers",
    "  (negative: MiniDDP costs less). Median [min, max] over runs.",
]


def overhead_table(rows: list[dict], views: list[str]) -> str:
    titles = ["model", "cap MB", "local"]
    for v in views:
        titles += [f"torch {v}", f"minddp {v}", f"minddp - torch {v}"]
    cells_all = []
    for r in rows:
        cells = [r["model"], f"{r['bucket_cap_mb']:g}", f"{r['local_ms']:.1f}"]
        for v in views:
            for impl in ("torch", "minddp"):
                key = f"overhead_{impl}_{v}_ms"
                cells.append(f"{with_spread(r, key, '{:.2f}')} ({100 * r[key.replace('_ms', '_fraction')]:.1f}%)")
            cells.append(with_spread(r, f"overhead_gap_{v}_ms", "{:+.2f}"))
        cells_all.append(cells)
    return "\n".join(OVERHEAD_TEXT) + "\n" + markdown_table(titles, cells_all)


def bound_table(rows: list[dict], views: list[str]) -> str:
    """Each wrapper's step as a multiple of the bound, and how far above it, paired by round (``benchlib/bound.py``)."""
    wrappers = [f"{impl}_{v}" for v in views for impl in ("torch", "minddp")]
    wrappers += ["minddp_auto"] if all("over_bound_minddp_auto_ms" in r for r in rows) else []
    forward = all("forward_ms" in r for r in rows)  # files written before it have none
    titles = ["model", "cap MB"] + (["forward"] if forward else []) + ["local", "allreduce flat", f"bound ({rows[0]['bound_rule']})"]
    titles += [w.replace("_", " ") for w in wrappers]
    cells_all = []
    for r in rows:
        keys = (("forward_ms",) if forward else ()) + ("local_ms", "allreduce_flat_ms")
        cells = [r["model"], f"{r['bucket_cap_mb']:g}"] + [f"{r[k]:.1f}" for k in keys]
        cells.append(with_spread(r, "bound_ms", "{:.1f}"))
        for w in wrappers:
            over = f"{r[f'over_bound_{w}_ms']:+.1f} ms"
            cells.append(f"{with_spread(r, f'x_bound_{w}', '{:.2f}')}x ({over})" if f"x_bound_{w}" in r else over)
        cells_all.append(cells)
    lines = [
        f"Against the bound, {RULES[rows[0]['bound_rule']]}: each wrapper's step as a multiple of the bound of the",
        "  same round (forward, the bare step and one flat all-reduce of every gradient, timed in that round), median",
        "  over rounds, then median [min, max] over runs; in brackets, ms above it. No DDP here does less work:",
        "  below 1.00x is noise.",
    ]
    return "\n".join(lines) + "\n" + markdown_table(titles, cells_all)


def memory_table(rows: list[dict], views: list[str], method: str) -> str:
    """Peak memory each wrapper adds, and the fraction of the all-reduce each hid."""
    titles = ["model", "cap MB"]
    for v in views:
        titles += [f"peak MiB torch/minddp {v}", f"hidden torch/minddp {v}"]
    cells_all = []
    for r in rows:
        cells = [r["model"], f"{r['bucket_cap_mb']:g}"]
        for v in views:
            cells.append(f"{r[f'peak_mem_torch_{v}_mb']:.1f} / {r[f'peak_mem_minddp_{v}_mb']:.1f}")
            cells.append(f"{r[f'hidden_fraction_torch_{v}']:.2f} / {r[f'hidden_fraction_minddp_{v}']:.2f}")
        cells_all.append(cells)
    lines = [
        f"Memory and overlap: peak MiB each wrapper adds (construction + steps; {method}), max over ranks,",
        "  the lowest of the wrapper's windows (Gloo's scratch memory lands on some: benchlib/memory.py);",
        "  hidden = (local + allreduce - step) / allreduce, clipped to [0, 1]: the all-reduce hidden behind compute",
    ]
    return "\n".join(lines) + "\n" + markdown_table(titles, cells_all)


def all_tables(cfg: dict, rows: list[dict]) -> str:
    views = cfg["bucket_views"]
    parts = [header(cfg), table(rows, views)]
    if "copy" in views and all("predicted_ms" in r for r in rows):
        parts.append(prediction.table(cfg, rows))
    if _has_bound(rows):
        parts.append(bound_table(rows, views))
    if cfg["overhead"]:
        parts.append(overhead_table(rows, views))
    parts.append(memory_table(rows, views, cfg["memory_method"]))
    return "\n\n".join(parts)


def make_learned_order_row(timed: dict) -> dict:
    """One ``--learned-order`` row from the medians and bucket counts of ``overlap.measure_learned_order``."""
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
    data = {"config": cfg, "results": rows}
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
    with ideal and the bound as lines (files from before the bound: no
    overlap, local + allreduce); beside it, the bucket sweep (if any)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = sorted({r["bucket_cap_mb"] for r in rows})
    main_cap = cfg["bucket_cap_mb"] if cfg["bucket_cap_mb"] in caps else caps[-1]
    main = [r for r in rows if r["bucket_cap_mb"] == main_cap]
    sweep = len(caps) > 1
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(13 if sweep else 7.5, 4.8), squeeze=False)
    ax = axes[0][0]
    impls = [("local_ms", "local"), ("naive_ms", "naive")]
    impls += [(f"{impl}_{v}_ms", f"{label} {v}") for v in cfg["bucket_views"]
              for impl, label in (("torch", "torch DDP"), ("minddp", "MiniDDP"))]  # fmt: skip
    width = 0.8 / len(impls)
    for j, (key, label) in enumerate(impls):
        xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(main))]
        ax.bar(xs, [r[key] for r in main], width, label=label)
    if _has_bound(main):
        floor, floor_label = [r["bound_ms"] for r in main], f"bound: {RULES[main[0]['bound_rule']]}"
    else:
        floor, floor_label = [r["local_ms"] + r["allreduce_ms"] for r in main], "no overlap"
    for i, r in enumerate(main):
        ax.hlines(r["ideal_ms"], i - 0.45, i + 0.45, colors="black", linestyles="-", label="ideal" if i == 0 else None)
        ax.hlines(floor[i], i - 0.45, i + 0.45, colors="red", linestyles="--", label=floor_label if i == 0 else None)
    ax.set_xticks(range(len(main)))
    ax.set_xticklabels([r["model"] for r in main])
    ax.set_ylabel("ms per step (median over runs)")
    ax.set_title(f"{cfg['backend']}/{cfg['device']}, {cfg['world_size']} ranks, bucket cap {main_cap:g} MB")
    ax.legend(fontsize=8)
    if sweep:
        ax = axes[0][1]
        for model in dict.fromkeys(r["model"] for r in rows):
            rs = sorted((r for r in rows if r["model"] == model), key=lambda r: r["bucket_cap_mb"])
            x = [r["bucket_cap_mb"] for r in rs]
            v = cfg["bucket_views"][0]
            (line,) = ax.plot(x, [r[f"torch_{v}_ms"] for r in rs], "o--", label=f"{model} torch DDP {v}")
            ax.plot(x, [r[f"minddp_{v}_ms"] for r in rs], "s-", color=line.get_color(), label=f"{model} MiniDDP {v}")
        ax.set_xscale("log")
        ax.set_xticks(caps)
        ax.set_xticklabels([f"{c:g}" for c in caps])
        ax.minorticks_off()
        ax.set_xlabel("bucket cap (MB)")
        ax.set_ylabel("ms per step (median over runs)")
        ax.set_title("bucket sweep")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
