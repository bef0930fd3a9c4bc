"""The few lines ``compare.py`` prints first: per model, the ratios and what the spread lets one say of them.

A ratio is MiniDDP's step over torch's DDP's, taken within each run and
reported as the median [min, max] over runs (``benchlib/spread.py``). The
verdict reads the whole spread, not the median: **faster** when every run's
ratio is below 1, **slower** when every one is above 1, **even** otherwise
(the runs disagree, so this machine cannot tell the two apart); after a
single run there is no spread, and no verdict.

Per model, at the main bucket cap (``--bucket-cap-mb``, torch's default 25 MB,
or the largest of a sweep): ``copy`` and ``view`` (``gradient_as_bucket_view``
False and True on both sides), and ``auto`` (``plan_buckets(MiniDDP(...))``)
against torch's DDP at its defaults. With a sweep, also ``auto`` against torch's
DDP at its best cap against ``auto``: the highest of the ratios ``auto`` / torch
at each cap, each taken in the same rounds (rows are timed one after another
and a loaded machine drifts between them, so comparing their step times would
mostly compare moments); with
the overlap bound (a real link, a GPU, a spare core: ``benchlib/bound.py``),
MiniDDP's best step and ``auto``'s as multiples of it; and the step ``auto``'s
planner predicted beside the one measured.
"""

from __future__ import annotations

from benchlib.tables import with_spread

VERDICTS = "faster: every run's ratio below 1; slower: every one above 1; even: the runs disagree"


def verdict(row: dict, key: str) -> str:
    """``faster``, ``slower`` or ``even`` from the spread of ``row[key]`` over runs; ``""`` after one run."""
    if row["runs"] < 2 or f"{key}_min" not in row:
        return ""
    if row[f"{key}_max"] < 1.0:
        return "faster"
    if row[f"{key}_min"] > 1.0:
        return "slower"
    return "even"


def _ratio(row: dict, key: str) -> str:
    said = verdict(row, key)
    return with_spread(row, key, "{:.3f}") + (f" {said}" if said else "")


def main_row(cfg: dict, rows: list[dict]) -> dict:
    """The model's row at ``cfg["bucket_cap_mb"]``, else at its largest cap."""
    at_cap = [r for r in rows if r["bucket_cap_mb"] == cfg["bucket_cap_mb"]]
    return at_cap[0] if at_cap else max(rows, key=lambda r: r["bucket_cap_mb"])


def fastest(rows: list[dict], wrapper: str) -> dict:
    """The row (bucket cap) where ``wrapper`` is fastest. Rows are timed one after another, and a loaded
    machine drifts between them, so where every row has it the step over the bound *of the same rounds*
    decides (``benchlib/bound.py``), else the step time itself."""
    key = f"x_bound_{wrapper}" if all(f"x_bound_{wrapper}" in r for r in rows) else f"{wrapper}_ms"
    return min(rows, key=lambda r: r[key])


def model_line(cfg: dict, rows: list[dict]) -> str:
    """One model's line (``rows``: its rows, one per bucket cap)."""
    row = main_row(cfg, rows)
    parts = [f"{v} {_ratio(row, f'ratio_{v}')}" for v in cfg["bucket_views"] if f"ratio_{v}" in row]
    auto = "ratio_auto" in row
    if auto:
        buckets = f"{row['auto_buckets']:g} bucket" + ("" if row["auto_buckets"] == 1 else "s")
        parts.append(f"auto ({buckets}) / torch default {_ratio(row, 'ratio_auto')}")
    if auto and len(rows) > 1:
        # torch's DDP at its best cap *against auto*: the highest ratio, each paired in its own rounds
        best = max(rows, key=lambda r: r["ratio_auto"])
        parts.append(f"auto / torch's best cap ({best['bucket_cap_mb']:g} MB) {_ratio(best, 'ratio_auto')}")
    if cfg.get("bound_rule") == "max" and all("x_bound_minddp_copy" in r for r in rows):
        best = fastest(rows, "minddp_copy")
        bound = [f"minddp's best ({best['bucket_cap_mb']:g} MB) {best['x_bound_minddp_copy']:.2f}x"]
        if "x_bound_minddp_auto" in row:
            bound.append(f"auto {row['x_bound_minddp_auto']:.2f}x")
        torch_best = fastest(rows, "torch_copy")
        bound.append(f"torch's best ({torch_best['bucket_cap_mb']:g} MB) {torch_best['x_bound_torch_copy']:.2f}x")
        parts.append("bound " + ", ".join(bound))
    if "auto_predicted_ms" in row:
        predicted, measured = row["auto_predicted_ms"], row["minddp_auto_ms"]
        parts.append(f"auto predicted {predicted:.1f} ms, measured {measured:.1f} (prediction {predicted / measured - 1:+.0%})")
    return f"  {row['model']:<6} {row['bucket_cap_mb']:g} MB: " + "; ".join(parts)


def summary(cfg: dict, rows: list[dict]) -> str:
    """The summary block: what the ratios mean, then one line per model."""
    by_model: dict[str, list[dict]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    runs = rows[0]["runs"] if rows else 0
    where = cfg.get("link", "loopback")
    lines = [
        f"Summary: minddp / torch's DDP, step time, median [min, max] over {runs} run(s) "
        f"({cfg['backend']}/{cfg['device']}, {cfg['world_size']} ranks, {where})"
        + ("" if runs < 2 else f"; {VERDICTS}"),
    ]
    if cfg.get("bound_rule") == "max" and any("x_bound_minddp_copy" in r for r in rows):
        lines.append("  bound = forward + max(backward and step, one flat all-reduce of every gradient), "
                     "all timed in the same rounds: a step as a multiple of it")  # fmt: skip
    lines += [model_line(cfg, model_rows) for model_rows in by_model.values()]
    return "\n".join(lines)
