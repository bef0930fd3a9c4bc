"""DDP, ZeRO stages 1-3 and torch's FSDP2 side by side: peak memory per rank (measured), CPU time, parameters.

    python benchmarks/fsdp_peers.py                       # N = 1, 2, 4 memory; time at N = 2
    python benchmarks/fsdp_peers.py --rounds 9 --json docs/fsdp_peers.json --text docs/fsdp_peers.txt
    python benchmarks/fsdp_peers.py --quick               # a smaller GPT, 1 round: a smoke test
    python benchmarks/fsdp_peers.py --world-sizes 2 --link 1gbit --setups torch-ddp,stage2,stage3,fsdp2
                                                          # the timing over 1 Gbit/s links (root)

``minddp_lab.models.GPT`` (8 blocks, 0.95 M parameters, head tied to the token
embedding), AdamW in fp32, 4 sequences of 64 tokens per rank, Gloo on CPU,
one intra-op thread per rank. The setups are ``benchlib/fsdp_setups.py``'s: torch's
DDP, MiniDDP, ZeRO stage 1 and 2 on MiniDDP, ``minddp.fsdp`` (stage 3) and
torch's ``fully_shard`` (FSDP2), both per block then the root.

**Memory, measured**: for each setup, in rank processes of its own, inside a
:class:`live_bytes.LiveBytes` window (a ``TorchDispatchMode`` that counts
every storage an operation creates while it lives): one step to warm up,
then the peak over one whole step (``zero_grad``, forward, backward,
``step``), the maximum over ranks. Two figures: every live tensor
(``all``), and *model state*: parameters (gathered units included),
gradients, optimizer state and the wrapper's communication buffers (buckets,
send and receive buffers), apart from activations (what autograd saved, the
gradients flowing between layers in backward, operators' temporaries; the
rule is ``benchlib/live_bytes.py``'s). Beside it the
ZeRO paper's formula with fp32 AdamW's constants, 4 bytes of parameter, 4 of
gradient, K = 8 of state (the paper's mixed-precision 2 + 2 + 12 also make
16 bytes, split otherwise): DDP 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N,
stage 3 16Ψ/N + its working set, two units' full parameters and gradients
(2 x 8 bytes x the largest unit: prefetch keeps the next unit while one
computes).

**Time**: at ``--time-world`` ranks, every setup built again (no tracker),
warmed up, then ``--rounds`` rounds of ``--steps`` steps, the setups in an
order that rotates each round; per step, wall time and this process's CPU
time (``time.process_time``: its threads, Gloo's included), the slowest rank,
median over rounds with [min, max].

With ``--link RATE`` the timing's ranks each run in a network namespace of
their own, joined by links shaped to that rate (:mod:`minddp_lab.links.namespaces`): the
all-gathers and reduce-scatters cross a real, rate-limited link, and wall
time shows whether prefetch hides them. Memory is measured as without it
(the link changes no tensor).

**Parameters**: after the steps, every setup's full parameters against
torch's DDP's (max absolute difference; same weights, same batches).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchlib.fsdp_setups import SETUPS, build, gpt_config, have_stage3, train_step, units  # noqa: E402
from benchlib.live_bytes import LiveBytes  # noqa: E402
from benchlib.outputs import emit, ranks_json  # noqa: E402
from minddp_lab.links import namespaces as links  # noqa: E402

MiB = 2**20


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _param_diff(full: dict, reference: dict) -> float:
    if set(full) != set(reference):
        raise RuntimeError(f"parameter names differ: {sorted(set(full) ^ set(reference))}")
    return max((full[n].float() - reference[n].float()).abs().max().item() for n in reference)


def measure_memory(name: str, cfg, rank: int) -> tuple[list[float], dict]:
    """(peak all, peak model state, after construction) in bytes, and the full parameters after 2 steps."""
    with LiveBytes() as live:
        setup = build(name, cfg)
        live.watch_parameters(setup.model)
        built = live.current
        train_step(setup, cfg, rank, 0)
        live.reset_peak()
        train_step(setup, cfg, rank, 1)
        peaks = [live.peak, live.peak_state, built]
    return peaks, setup.full_parameters()


def trained(name: str, cfg, rank: int) -> dict:
    """The full parameters of ``name`` after the same 2 steps, measured by nothing."""
    setup = build(name, cfg)
    for step in range(2):
        train_step(setup, cfg, rank, step)
    return setup.full_parameters()


class StepClock:
    """CPU ms inside ``optimizer.step()`` alone (its pre and post hooks), summed until read."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.total = 0.0
        self._start = 0.0
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)

    def _before(self, *_):
        self._start = time.process_time()

    def _after(self, *_):
        self.total += (time.process_time() - self._start) * 1e3

    def read(self) -> float:
        value, self.total = self.total, 0.0
        return value


def measure_time(setups: list[str], cfg, rank: int, rounds: int, steps: int) -> tuple[dict, dict]:
    """Per setup: per-round medians of (wall, CPU, optimizer-step CPU) ms per step, slowest rank; and full
    parameters at the end."""
    built = {name: build(name, cfg) for name in setups}
    clocks = {name: StepClock(setup.optimizer) for name, setup in built.items()}
    step_no = {name: 0 for name in setups}
    for name, setup in built.items():
        for _ in range(2):
            train_step(setup, cfg, rank, step_no[name])
            step_no[name] += 1
    wall: dict[str, list[float]] = {n: [] for n in setups}
    cpu: dict[str, list[float]] = {n: [] for n in setups}
    opt_cpu: dict[str, list[float]] = {n: [] for n in setups}
    for r in range(rounds):
        for name in setups[r % len(setups):] + setups[:r % len(setups)]:
            setup = built[name]
            dist.barrier()
            clocks[name].read()
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                train_step(setup, cfg, rank, step_no[name])
                step_no[name] += 1
            w, c, o = _max_over_ranks([(time.perf_counter() - w0) / steps * 1e3,
                                       (time.process_time() - c0) / steps * 1e3, clocks[name].read() / steps])
            wall[name].append(w)
            cpu[name].append(c)
            opt_cpu[name].append(o)
    return ({n: {"wall_ms": wall[n], "cpu_ms": cpu[n], "step_cpu_ms": opt_cpu[n]} for n in setups},
            {n: s.full_parameters() for n, s in built.items()})


def memory_main(rank: int, world_size: int, args: dict, out_path: str) -> None:
    """One setup's memory, in rank processes of its own (what an earlier setup leaves behind, its
    hooks, its process group's state, stays out of the count), then torch's DDP's parameters."""
    torch.set_num_threads(1)
    cfg = gpt_config(args["quick"])
    peaks, full = measure_memory(args["setup"], cfg, rank)
    reference = full if args["setup"] == "torch-ddp" else trained("torch-ddp", cfg, rank)
    result = {"memory": dict(zip(("peak_all", "peak_state", "built"), _max_over_ranks(peaks))),
              "param_diff": _param_diff(full, reference)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def time_main(rank: int, world_size: int, args: dict, out_path: str) -> None:
    torch.set_num_threads(1)
    cfg = gpt_config(args["quick"])
    setups = args["setups"]
    times, full = measure_time(setups, cfg, rank, args["rounds"], args["steps"])
    result = {"time": times, "time_param_diff": {n: _param_diff(full[n], full["torch-ddp"]) for n in setups}}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def measure(world_size: int, args: dict) -> dict:
    """Every setup's memory (each in fresh rank processes), and the timings at ``--time-world``."""
    result: dict = {"world_size": world_size, "memory": {}, "param_diff": {}}
    for name in args["setups"]:
        one = ranks_json(memory_main, world_size, {**args, "setup": name})
        result["memory"][name], result["param_diff"][name] = one["memory"], one["param_diff"]
    if world_size == args["time_world"]:
        result.update(ranks_json(time_main, world_size, args, args.get("link")))
    return result


def formula(setup: str, psi: int, n: int, largest_unit: int) -> float | None:
    """The paper's bytes per rank, fp32 AdamW constants (4 + 4 + 8); stage 3 with its working set."""
    return {"torch-ddp": 16 * psi, "ddp": 16 * psi, "stage1": 8 * psi + 8 * psi / n, "stage2": 4 * psi + 12 * psi / n,
            "stage3": 16 * psi / n + 2 * 8 * largest_unit, "fsdp2": 16 * psi / n + 2 * 8 * largest_unit}.get(setup)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}, {max(values):.1f}]"


def report(results: list[dict], cfg, args: dict) -> str:
    sizes = units(cfg)
    psi, largest = sum(sizes.values()), max(sizes.values())
    lines = [f"minddp_lab.models.GPT: {psi:,} parameters, {len(sizes)} units (largest {largest:,} parameters); AdamW fp32; "
             "4 x 64 tokens per rank; Gloo, CPU, 1 thread per rank",
             "memory: peak over one whole step (zero_grad, forward, backward, step), every storage an operation "
             "created (a TorchDispatchMode), max over ranks; 'state' = parameters (gathered units included), gradients, "
             "optimizer state, communication buffers, not activations (saved, flowing between layers, temporaries); formula: fp32 AdamW 4 + 4 + 8 bytes per parameter, stage 3 + 2 units x 8 bytes x the "
             "largest unit", ""]
    for res in results:
        n = res["world_size"]
        lines += [f"N = {n}", "| setup | peak all MiB | peak state MiB | formula MiB | state / formula | after build MiB "
                  "| max param diff vs torch DDP |", "|---|---:|---:|---:|---:|---:|---:|"]
        for name, m in res["memory"].items():
            f = formula(name, psi, n, largest)
            lines.append(f"| {name} | {m['peak_all'] / MiB:.2f} | {m['peak_state'] / MiB:.2f} | "
                         f"{f / MiB if f else float('nan'):.2f} | {m['peak_state'] / f if f else float('nan'):.2f} | "
                         f"{m['built'] / MiB:.2f} | {res['param_diff'][name]:.1e} |")
        lines.append("")
        if "time" in res:
            t = res["time"]
            ref_cpu = statistics.median(t["torch-ddp"]["cpu_ms"])
            fsdp2_cpu = statistics.median(t["fsdp2"]["cpu_ms"]) if "fsdp2" in t else float("nan")
            lines += [f"time at N = {n}{' over links shaped to ' + args['link'] if args.get('link') else ''}: "
                      f"{args['rounds']} rounds x {args['steps']} steps, median [min, max] over "
                      "rounds, slowest rank; optimizer.step() alone: CPU ms inside it (its pre and post hooks)",
                      "| setup | wall ms/step | CPU ms/step | CPU / torch DDP | CPU / FSDP2 | optimizer.step() CPU ms "
                      "| max param diff vs torch DDP |", "|---|---:|---:|---:|---:|---:|---:|"]
            for name, v in t.items():
                c = statistics.median(v["cpu_ms"])
                step_cpu = _spread(v["step_cpu_ms"]) if "step_cpu_ms" in v else "-"
                lines.append(f"| {name} | {_spread(v['wall_ms'])} | {_spread(v['cpu_ms'])} | {c / ref_cpu:.2f} | "
                             f"{c / fsdp2_cpu:.2f} | {step_cpu} | {res['time_param_diff'][name]:.1e} |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", default="1,2,4")
    p.add_argument("--time-world", type=int, default=2, help="world size of the timing (0: none)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="steps per round")
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--quick", action="store_true", help="a 2-block GPT, N = 2, 1 round of 1 step")
    p.add_argument("--link", default="loopback", metavar="RATE",
                   help=f"loopback, or {links.ACCEPTED}: the timing's ranks on shaped links (needs root)")
    p.add_argument("--json")
    p.add_argument("--text")
    a = p.parse_args(argv)
    if a.link != "loopback":
        try:
            a.link = links.format_rate(links.parse_rate(a.link))
        except links.LinkError as e:
            p.error(f"--link: {e}, or loopback")
        if links.missing():
            p.error(f"--link {a.link}: {links.missing()}")
    setups = [s for s in a.setups.split(",") if s]
    unknown = set(setups) - set(SETUPS)
    if unknown or "torch-ddp" not in setups:
        p.error(f"--setups: known {', '.join(SETUPS)}, torch-ddp required (the reference); got {a.setups}")
    if "stage3" in setups and not have_stage3():
        print("stage 3: minddp.fsdp is not in this checkout; left out", file=sys.stderr)
        setups.remove("stage3")
    args = {"setups": setups, "quick": a.quick, "rounds": 1 if a.quick else a.rounds, "steps": 1 if a.quick else a.steps,
            "time_world": 2 if a.quick else a.time_world, "link": None if a.link == "loopback" else a.link}
    worlds = [2] if a.quick else [int(w) for w in a.world_sizes.split(",")]
    load_before = os.getloadavg()[0]
    results = [measure(n, args) for n in worlds]
    text = report(results, gpt_config(a.quick), args)
    text += f"load average (1 min) {load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after"
    emit(text, a.text, a.json, {"args": args, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
