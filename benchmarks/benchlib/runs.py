"""Running the rank processes of ``compare.py`` and reading back what they wrote."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from benchlib.progress import Progress, clock, total_units
from minddp.ddp.observers import trace_view


def trace_files(path: str, models: list[str]) -> dict[str, str]:
    """model -> trace path: ``path`` itself for one model, else ``PATH-model.json``."""
    if len(models) == 1:
        return {models[0]: os.path.abspath(path)}
    stem = os.path.abspath(path)[: -len(".json")]
    return {m: f"{stem}-{m}.json" for m in models}


def report_traces(cfg: dict, plot: bool) -> None:
    """One line per traced model (its last step on every rank), and the PNGs with ``--plot``."""
    for model, path in cfg["trace_files"].items():
        with open(path) as f:
            trace = json.load(f)
        print(f"trace {model}: {path} (open in https://ui.perfetto.dev)")
        for views in trace_view.read_steps(trace).values():
            print(f"  {views[-1].summary()}")
        if plot:
            png = path[: -len(".json")] + ".png"
            trace_view.draw_overlap(trace, png, title=f"{model}, bucket cap {cfg['bucket_caps'][0]:g} MB")
            print(f"  wrote {png}")


def measure(cfg: dict) -> tuple[list[list[dict]], list[dict], dict] | None:
    """Every timing run, each row (model and cap) in fresh rank processes of its own, then the
    ``--learned-order`` and ``--trace`` extras, then the memory run. Returns (each run's rows, the
    learned-order entries, the memory run's output), or None when a rank failed. Rank 0 of each set of
    processes shows how far the whole is (``benchlib/progress.py``), counting from now."""
    import torch.multiprocessing as mp

    from benchlib import memory
    from benchlib.rank_work import cases, extras_main, memory_main, timing_main
    from minddp.launch import RankFailed, spawn

    cfg = {**cfg, "started": time.time()}  # for the progress line's elapsed and remaining time
    with tempfile.TemporaryDirectory(prefix="minddp-compare-") as tmp:
        out_path = os.path.join(tmp, "out.json")

        def ranks_write(fn, fn_cfg: dict) -> dict:
            spawn(fn, cfg["world_size"], fn_cfg, out_path, backend=cfg["backend"], link=cfg.get("link"))
            with open(out_path) as f:
                return json.load(f)

        saved = dict(os.environ)
        try:
            timed = [[ranks_write(timing_main, {**cfg, "run": run, "case": case})["row"]
                     for case in range(len(cases(cfg)))] for run in range(cfg["runs"])]
            learned = []
            if cfg.get("learned_order_cap_mb") or cfg.get("trace_files"):
                learned = ranks_write(extras_main, cfg)["learned_order"]
            # Fresh processes for memory, with the allocator setting that
            # makes RSS follow live tensors (benchlib/memory.py says why).
            os.environ.update(memory.ALLOCATOR_ENV)
            peaks = ranks_write(memory_main, cfg)
        except (RankFailed, mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            print(f"error: a rank failed:\n{e}", file=sys.stderr)
            return None
        finally:
            os.environ.clear()
            os.environ.update(saved)
    Progress(total_units(cfg), cfg["started"]).finish(f"measured in {clock(time.time() - cfg['started'])}")
    return timed, learned, peaks
