"""From block times to the figures of one table row: medians, ratios, overheads, and their spread over runs.

Within one run (fresh rank processes for each row), for each implementation,
the *median over rounds* of its block times. From those medians:

* ``ratio_V`` = minddp_V / torch_V, for ``V`` in ``copy`` and ``view``
  (``gradient_as_bucket_view`` False / True, same setting on both sides);
* ``ratio_auto`` = minddp_auto / torch_copy: MiniDDP choosing its buckets
  (``plan_buckets``) against torch's DDP at its defaults;
* ``overhead_W_ms`` for each wrapper ``W`` run with the no-communication
  hook: the median over rounds of (W's block - the bare model's block *of the
  same round*). Pairing by round cancels most of the machine's drift, which
  is why this figure is steadier than a step time;
* ``overhead_gap_V_ms``: the same pairing between MiniDDP and torch's DDP
  (minddp_V_nocomm - torch_V_nocomm): negative means MiniDDP costs less;
* ``bound_ms`` (where ``allreduce_flat`` was timed): the floor under any DDP
  step here, the bare step plus (or, with a core to spare, overlapped with)
  one all-reduce of every gradient in a flat buffer, paired by round; and
  ``over_bound_W_ms`` for each wrapper ``W`` with communication: how far
  above it (``benchlib/bound.py``).

Over ``--runs`` runs, every such figure is reported as the median over runs
with its minimum and maximum (``_min``/``_max``): with 5 runs, min-max is
the range a sixth run lands in with probability 4/6 under no drift, and
anything quoted from it is quoted with it.
"""

from __future__ import annotations

import statistics

from benchlib import bound
from benchlib.wrappers import AUTO, NOCOMM

VIEWS = ("copy", "view")


def hidden_fraction(local: float, allreduce: float, t: float) -> float:
    """(local + allreduce - t) / allreduce in [0, 1]: 1 = all communication hidden."""
    if allreduce <= 0:
        return 0.0
    return min(1.0, max(0.0, (local + allreduce - t) / allreduce))


def _paired(a: list[float], b: list[float]) -> float:
    """Median over rounds of a[i] - b[i]."""
    return statistics.median(x - y for x, y in zip(a, b))


def run_figures(blocks: dict[str, list[float]], views: list[str], bound_rule: str | None = None) -> dict[str, float]:
    """One run's figures for one row (see the module docstring)."""
    med = {f"{name}_ms": statistics.median(times) for name, times in blocks.items()}
    out = dict(med)
    if bound.FLAT in blocks:
        wrappers = [f"{impl}_{v}" for v in views for impl in ("torch", "minddp")] + ([AUTO] if AUTO in blocks else [])
        out.update(bound.bound_figures(blocks, bound_rule, wrappers))
    if AUTO in blocks:
        out["ratio_auto"] = med[f"{AUTO}_ms"] / med["torch_copy_ms"]
    if "local" in blocks and "allreduce" in blocks:  # per run, so that it comes with its spread over runs
        wrappers = [f"{impl}_{v}" for v in views for impl in ("torch", "minddp")] + ([AUTO] if AUTO in blocks else [])
        for w in wrappers:
            out[f"hidden_fraction_{w}"] = hidden_fraction(med["local_ms"], med["allreduce_ms"], med[f"{w}_ms"])
    for v in views:
        out[f"ratio_{v}"] = med[f"minddp_{v}_ms"] / med[f"torch_{v}_ms"]
        if f"torch_{v}{NOCOMM}" not in blocks:
            continue
        for impl in ("torch", "minddp"):
            out[f"overhead_{impl}_{v}_ms"] = _paired(blocks[f"{impl}_{v}{NOCOMM}"], blocks["local"])
        out[f"overhead_gap_{v}_ms"] = _paired(blocks[f"minddp_{v}{NOCOMM}"], blocks[f"torch_{v}{NOCOMM}"])
    return out


SPREAD_PREFIXES = ("ratio_", "overhead_", "bound_", "over_bound_", "x_bound_", "hidden_fraction_")  # the figures reported with _min and _max


def make_row(cfg: dict, per_run: list[dict], max_param_diff: float, peak_mb: dict[str, float]) -> dict:
    """One row from ``per_run`` (:func:`run_figures` of each run, same model and cap)."""
    row = {
        "model": per_run[0]["model"],
        "backend": cfg["backend"],
        "device": cfg["device"],
        "world_size": cfg["world_size"],
        "bucket_cap_mb": per_run[0]["bucket_cap_mb"],
        "runs": len(per_run),
    }
    keys = [k for k in per_run[0] if k not in ("model", "bucket_cap_mb")]
    for key in keys:
        values = [r[key] for r in per_run]
        row[key] = statistics.median(values)
        if key.startswith(SPREAD_PREFIXES):
            row[f"{key}_min"], row[f"{key}_max"] = min(values), max(values)
    local, ar = row["local_ms"], row["allreduce_ms"]
    row["ideal_ms"] = max(local, ar)
    if "bound_ms" in row:
        row["bound_rule"] = cfg["bound_rule"]
        for key in [k for k in keys if k.startswith("over_bound_")]:
            row[key.replace("_ms", "_fraction")] = row[key] / row["bound_ms"]
    for v in cfg["bucket_views"]:
        for impl in ("torch", "minddp"):
            row.setdefault(f"hidden_fraction_{impl}_{v}", hidden_fraction(local, ar, row[f"{impl}_{v}_ms"]))
            row[f"peak_mem_{impl}_{v}_mb"] = peak_mb[f"{impl}_{v}"]
            if f"overhead_{impl}_{v}_ms" in row:
                row[f"overhead_{impl}_{v}_fraction"] = row[f"overhead_{impl}_{v}_ms"] / local
    row["max_param_diff"] = max_param_diff
    if f"{AUTO}_ms" in row:
        row.setdefault(f"hidden_fraction_{AUTO}", hidden_fraction(local, ar, row[f"{AUTO}_ms"]))
        row[f"peak_mem_{AUTO}_mb"] = peak_mb[AUTO]
    row["per_run"] = {k: [r[k] for r in per_run] for k in keys if k.startswith(SPREAD_PREFIXES)}
    return row


def make_rows(cfg: dict, runs: list[list[dict]], memory: list[dict]) -> list[dict]:
    """Rows from every run's timed entries (``runs[i]``: run i's ``{"model", "bucket_cap_mb",
    "block_ms", "max_param_diff"}`` in case order) and the memory run's peaks."""
    rows = []
    for case, mem in enumerate(memory):
        per_run, diff, auto_diff = [], 0.0, None
        for entries in runs:
            entry = entries[case]
            blocks = dict(entry["block_ms"])
            if "naive" not in blocks:  # measured at the model's first cap only
                blocks["naive"] = next(e["block_ms"]["naive"] for e in entries if e["model"] == entry["model"])
            figures = run_figures(blocks, cfg["bucket_views"], cfg["bound_rule"])
            if "predicted_ms" in entry:  # the simulator's step for this cap (benchlib/prediction.py)
                figures["predicted_ms"] = entry["predicted_ms"]
            if "auto_buckets" in entry:  # how many buckets plan_buckets chose in this run
                figures["auto_buckets"] = entry["auto_buckets"]
                if "auto_predicted_ms" in entry:  # and the step its planner predicted for them
                    figures["auto_predicted_ms"] = entry["auto_predicted_ms"]
                auto_diff = max(auto_diff or 0.0, entry["max_param_diff_auto"])
            per_run.append({"model": entry["model"], "bucket_cap_mb": entry["bucket_cap_mb"], **figures})
            diff = max(diff, entry["max_param_diff"])
        row = make_row(cfg, per_run, diff, mem["peak_mb"])
        row["peak_mem_windows_mb"] = mem.get("peak_windows_mb", {})  # every window's reading; the lowest is the peak
        if auto_diff is not None:
            row["max_param_diff_auto"] = auto_diff  # bucketing may reorder sums: float32 rounding, not 0
            row["per_run"]["auto_buckets"] = [r["auto_buckets"] for r in per_run]
        rows.append(row)
    return rows
