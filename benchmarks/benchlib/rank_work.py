"""What each rank process of ``compare.py`` runs: one row of one timing run, the extras, the memory run.

``benchlib/runs.py`` starts these in fresh processes and reads back the
JSON that rank 0 writes; ``benchlib/timing.py``'s :class:`Runner` does the
measuring of one row.
"""

from __future__ import annotations

import contextlib
import io
import json
import statistics

import torch
import torch.distributed as dist

from benchlib import memory, overlap, prediction, progress
from benchlib.progress import Progress
from benchlib.timing import Runner


def _device(cfg: dict) -> torch.device:
    if cfg["device"] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cases(cfg: dict) -> list[tuple[str, float]]:
    """(model, bucket cap) of every row, in the table's order."""
    return [(name, cap) for name in cfg["models"] for cap in cfg["bucket_caps"]]


def _progress(cfg: dict, rank: int) -> Progress | None:
    """Rank 0 reports how far the whole benchmark is (``benchlib/progress.py``); the others stay quiet."""
    return Progress(progress.total_units(cfg), cfg.get("started")) if rank == 0 else None


def timing_main(rank: int, world_size: int, cfg: dict, out_path: str) -> None:
    """Every rank of one row (``cfg["case"]`` of :func:`cases`) in one timing run, inside an initialised
    process group. ``benchlib/runs.py`` starts fresh processes for every row: ``plan_buckets`` times
    its proposals on real steps, so it chooses as in a user's script only where no other model or cap has
    trained in its process first (``Runner.warm_up``). The simulator's inputs come after the timings, in the
    same processes."""
    torch.set_num_threads(cfg["threads_per_rank"])
    device = _device(cfg)
    bar = _progress(cfg, rank)
    case, run = cfg["case"], cfg["run"]
    name, cap = cases(cfg)[case]
    first_cap = cap == cfg["bucket_caps"][0]  # naive and auto's decision: once per model
    solo = [dist.new_group([r]) for r in range(world_size)][rank]  # every rank creates every group
    stage = f"run {run + 1}/{cfg['runs']}, {name}, cap {cap:g} MB"

    def on_round(r: int) -> None:
        if bar is not None:
            bar.update(progress.units_before(cfg, run, case, r), stage, f"round {r + 1}/{cfg['repeats']}")

    runner = Runner(cfg, name, cap, rank, world_size, device, on_round)
    result = runner.measure(with_naive=first_cap)
    if first_cap and run == 0 and result.get("auto_decision") and bar is not None:
        bar.note(f"{name}: {result['auto_decision']}")
    if device.type == "cpu":
        if bar is not None:
            bar.update(progress.units_before(cfg, run, case, cfg["repeats"]), stage, "the simulator's inputs")
        inputs = prediction.measure_inputs(runner, solo)
        if inputs is not None:  # rank 0's
            local_ms = statistics.median(result["block_ms"]["local"])
            result["predicted_ms"] = prediction.predicted_step(inputs, cap, local_ms, world_size,
                                                               overlap=cfg["bound_rule"] == "max")
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"row": {"model": name, "bucket_cap_mb": cap, **result}}, f)


def extras_main(rank: int, world_size: int, cfg: dict, out_path: str) -> None:
    """Every rank of the ``--learned-order`` and ``--trace`` steps, in processes of their own."""
    torch.set_num_threads(cfg["threads_per_rank"])
    device = _device(cfg)
    bar = _progress(cfg, rank)

    def make_runner(name: str, cap: float) -> Runner:
        return Runner(cfg, name, cap, rank, world_size, device)

    def say(text: str) -> None:
        if bar is not None:
            bar.note(text)

    learned = [overlap.learned_order_row(cfg, make_runner, say)] if cfg.get("learned_order_cap_mb") else []
    overlap.record_traces(cfg, make_runner, say)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"learned_order": learned}, f)


def memory_main(rank: int, world_size: int, cfg: dict, out_path: str) -> None:
    """Every rank of the memory run: fresh processes, started with the
    allocator setting of ``memory.ALLOCATOR_ENV`` (see ``benchlib/memory.py``)."""
    torch.set_num_threads(cfg["threads_per_rank"])
    device = _device(cfg)
    with contextlib.redirect_stdout(io.StringIO()):  # plan_buckets's decision: shown by timing_main
        out = _peak_memory_rows(cfg, rank, world_size, device, _progress(cfg, rank))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"memory": out, "method": memory.method(device)}, f)


def _peak_memory_rows(cfg: dict, rank: int, world_size: int, device: torch.device, bar: Progress | None) -> list[dict]:
    out, seen = [], set()
    for case, (name, cap) in enumerate(cases(cfg)):
        if bar is not None:
            bar.update(progress.units_before(cfg, cfg["runs"], 0) + case, "peak memory", f"{name}, cap {cap:g} MB")
        runner = Runner(cfg, name, cap, rank, world_size, device)
        if name not in seen:  # unmeasured: first-use costs (code pages, lazy init) land here
            runner.peak_memory(n_steps=2, windows=1)
            seen.add(name)
        readings = runner.peak_memory()
        out.append({"model": name, "bucket_cap_mb": cap, "peak_mb": memory.lowest(readings), "peak_windows_mb": readings})
    return out
