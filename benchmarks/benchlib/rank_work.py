"""What each rank process of ``compare.py`` runs: one timing run (every row of the table), and the memory run.

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


def _cases(cfg: dict) -> list[tuple[str, float]]:
    return [(name, cap) for name in cfg["models"] for cap in cfg["bucket_caps"]]


def _progress(cfg: dict, rank: int) -> Progress | None:
    """Rank 0 reports how far the whole benchmark is (``benchlib/progress.py``); the others stay quiet."""
    return Progress(progress.total_units(cfg), cfg.get("started")) if rank == 0 else None


def timing_main(rank: int, world_size: int, cfg: dict, out_path: str) -> None:
    """Every rank of one timing run (inside an initialised process group).
    ``cfg["extras"]``: also the ``--learned-order`` and ``--trace`` steps."""
    torch.set_num_threads(cfg["threads_per_rank"])
    device = _device(cfg)
    bar = _progress(cfg, rank)
    out, seen = [], set()
    solos = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    inputs: dict = {}  # model -> the simulator's inputs (rank 0; None on the others)
    for case, (name, cap) in enumerate(_cases(cfg)):
        stage = f"run {cfg['run'] + 1}/{cfg['runs']}, {name}, cap {cap:g} MB"

        def on_round(r: int, case=case, stage=stage) -> None:
            if bar is not None:
                bar.update(progress.units_before(cfg, cfg["run"], case, r), stage, f"round {r + 1}/{cfg['repeats']}")

        if name not in inputs and device.type == "cpu":
            if bar is not None:
                bar.update(progress.units_before(cfg, cfg["run"], case), stage, "the simulator's inputs")
            inputs[name] = prediction.measure_inputs(Runner(cfg, name, cap, rank, world_size, device), solos[rank])
        result = Runner(cfg, name, cap, rank, world_size, device, on_round).measure(with_naive=name not in seen)
        if name not in seen and cfg["run"] == 0 and result.get("auto_decision") and bar is not None:
            bar.note(f"{name}: {result['auto_decision']}")
        seen.add(name)
        if inputs.get(name) is not None:
            local_ms = statistics.median(result["block_ms"]["local"])
            result["predicted_ms"] = prediction.predicted_step(inputs[name], cap, local_ms, world_size,
                                                               overlap=cfg["bound_rule"] == "max")
        out.append({"model": name, "bucket_cap_mb": cap, **result})

    def make_runner(name: str, cap: float) -> Runner:
        return Runner(cfg, name, cap, rank, world_size, device)

    def say(text: str) -> None:
        if bar is not None:
            bar.note(text)

    learned = []
    if cfg["extras"]:
        learned = [overlap.learned_order_row(cfg, make_runner, say)] if cfg.get("learned_order_cap_mb") else []
        overlap.record_traces(cfg, make_runner, say)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"rows": out, "learned_order": learned}, f)


def memory_main(rank: int, world_size: int, cfg: dict, out_path: str) -> None:
    """Every rank of the memory run: fresh processes, started with the
    allocator setting of ``memory.ALLOCATOR_ENV`` (see ``benchlib/memory.py``)."""
    torch.set_num_threads(cfg["threads_per_rank"])
    device = _device(cfg)
    with contextlib.redirect_stdout(io.StringIO()):  # bucket_cap_mb="auto"'s decision: shown by timing_main
        out = _peak_memory_rows(cfg, rank, world_size, device, _progress(cfg, rank))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"memory": out, "method": memory.method(device)}, f)


def _peak_memory_rows(cfg: dict, rank: int, world_size: int, device: torch.device, bar: Progress | None) -> list[dict]:
    out, seen = [], set()
    for case, (name, cap) in enumerate(_cases(cfg)):
        if bar is not None:
            bar.update(progress.units_before(cfg, cfg["runs"], 0) + case, "peak memory", f"{name}, cap {cap:g} MB")
        runner = Runner(cfg, name, cap, rank, world_size, device)
        if name not in seen:  # unmeasured: first-use costs (code pages, lazy init) land here
            runner.peak_memory(n_steps=2, windows=1)
            seen.add(name)
        readings = runner.peak_memory()
        out.append({"model": name, "bucket_cap_mb": cap, "peak_mb": memory.lowest(readings), "peak_windows_mb": readings})
    return out
