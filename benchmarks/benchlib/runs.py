"""Running the rank processes of ``compare.py`` and reading back what they wrote."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from benchlib.progress import Progress, clock, total_units
from minddp.observe import trace_view


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
    """Every timing run (fresh rank processes each), then the memory run.
    Returns (each run's timed entries, the learned-order entries, the memory
    run's output), or None when a rank failed. Rank 0 of each shows how far
    the whole is (``benchlib/progress.py``), counting from now."""
    import torch.multiprocessing as mp

    from benchlib import memory
    from benchlib.rank_work import memory_main, timing_main
    from minddp.launch import RankFailed, spawn

    cfg = {**cfg, "started": time.time()}  # for the progress line's elapsed and remaining time
    runs, learned = [], []
    with tempfile.TemporaryDirectory(prefix="minddp-compare-") as tmp:
        timed_path, mem_path = os.path.join(tmp, "timed.json"), os.path.join(tmp, "memory.json")
        saved = dict(os.environ)
        try:
            for run in range(cfg["runs"]):
                # The learned-order and trace extras once, in the first run.
                run_cfg = {**cfg, "run": run, "extras": run == 0}
                spawn(timing_main, cfg["world_size"], run_cfg, timed_path, backend=cfg["backend"], link=cfg.get("link"))
                with open(timed_path) as f:
                    timed = json.load(f)  # {"rows": [...], "learned_order": [...]}
                runs.append(timed["rows"])
                learned += timed["learned_order"]
            # Fresh processes for memory, with the allocator setting that
            # makes RSS follow live tensors (benchlib/memory.py says why).
            os.environ.update(memory.ALLOCATOR_ENV)
            spawn(memory_main, cfg["world_size"], cfg, mem_path, backend=cfg["backend"], link=cfg.get("link"))
        except (RankFailed, mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            print(f"error: a rank failed:\n{e}", file=sys.stderr)
            return None
        finally:
            os.environ.clear()
            os.environ.update(saved)
        with open(mem_path) as f:
            peaks = json.load(f)
    Progress(total_units(cfg), cfg["started"]).finish(f"measured in {clock(time.time() - cfg['started'])}")
    return runs, learned, peaks
