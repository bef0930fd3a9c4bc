"""Is the stage-3 simulator honest? ``minddp_lab.simulate.stage3``'s prediction against a measured minddp.fsdp step.

    python benchmarks/validate_stage3.py                       # 2 ranks, Gloo, GPT, 9 rounds
    python benchmarks/validate_stage3.py --rounds 21 --json docs/validate_stage3.json --text docs/validate_stage3.txt

One spawned job of ``--world-size`` Gloo ranks (one intra-op thread each) does,
in rounds (so that a shared machine's load drifts over all of it alike):

1. **the network**: ``minddp.fsdp``'s all-gather and reduce-scatter alone,
   float32 buffers of 64 KiB to 4 MiB, each after a little computation as a
   step issues them; :func:`minddp_lab.network.fit_link` fits alpha and
   bandwidth to their medians (a half all-reduce each: the fit is given
   twice their time, the all-reduce it models);
2. **the compute**: on this rank alone, each GPT block's forward and backward
   at the step's activation shape, the whole model's forward and backward
   (what is not in a block is the root unit's: embeddings, final norm, head,
   loss) and AdamW's step over all the parameters: how the compute splits
   among the units. How much there is comes from the stage-3 step itself
   with its collectives made local (``fsdp_setups.collectives_made_local``:
   no communication, all else as it is, the hooks' Python and the sharded
   optimizer included): every unit's times are scaled to add up to it
   (isolated blocks leave out the hooks and the shards' bookkeeping);
3. **the measurement**: ``minddp.fsdp`` steps (each block, then the root;
   AdamW over the shards), prefetch on and off, each block of steps timed on
   the slowest rank.

Rank 0 then replays the step with :func:`minddp_lab.simulate.stage3.simulate_stage3`
(units: the root first, then the blocks), with ``overlap`` (communication
beside compute) and ``shared`` (``overlap=False``: on 2 cores a collective
pauses compute), the last block kept gathered from its forward into its
backward and the root through the whole step, as ``minddp.fsdp`` keeps them
(``keep_last``, ``keep_root``). Error = predicted / measured - 1. What the
replay leaves out: that a collective costs more beside compute than alone
(Gloo's threads take their CPU from the ranks' computing), and the ranks'
drift against each other.
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

from benchlib.fsdp_setups import collectives_made_local  # noqa: E402
from benchlib.outputs import emit, ranks_json  # noqa: E402
from minddp.fsdp.collectives import all_gather, gloo_collectives, start_reduce_scatter  # noqa: E402
from minddp_lab.models import GPT, GPTConfig  # noqa: E402
from minddp_lab.network import fit_link  # noqa: E402
from minddp_lab.simulate.stage3 import Stage3Policy, Unit, simulate_stage3  # noqa: E402

FIT_SIZES = [64 * 1024 * 4**k for k in range(4)]  # 64 KiB .. 4 MiB
BATCH = 4


def _ms(fn, reps: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def _slowest(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def halves_ms(n: int, world_size: int) -> float:
    """One all-gather and one reduce-scatter of an ``n``-byte buffer, ms each (their mean): the very
    collectives ``minddp.fsdp`` runs (on Gloo at two ranks its reduce-scatter is one exchange).

    Each is timed alone, after a little computation, as a step issues them: one at a time between
    layers. Back to back in a tight loop Gloo's threads never fall asleep, and each collective costs
    about half as much (a fit to those put the model 13-34% below the measured step).
    """
    full, piece = torch.zeros(n // 4), torch.zeros(n // 4 // world_size)
    group, rank = dist.group.WORLD, dist.get_rank()
    on_gloo = gloo_collectives(group, full.device)
    reduce = lambda: start_reduce_scatter(full, piece.numel(), rank, group, on_gloo).wait(full.dtype)  # noqa: E731
    work = torch.randn(128, 128)
    reps = max(2, min(20, (2 << 20) // n))

    def between_layers_ms(collective) -> float:
        dist.barrier()
        total = 0.0
        for _ in range(reps):
            for _ in range(10):
                work @ work
            total += _ms(collective)
        return total / reps

    return (between_layers_ms(lambda: all_gather(full, piece, group=group)) + between_layers_ms(reduce)) / 2


def compute_profile(cfg: GPTConfig, tokens: torch.Tensor, repeats: int = 3) -> dict:
    """This rank alone: each block's forward and backward, the whole model's, AdamW's step (ms), the fastest of
    ``repeats`` (a busy machine only ever adds time)."""
    runs = [_compute_once(cfg, tokens) for _ in range(repeats)]
    fastest = lambda pick: min(pick(r) for r in runs)  # noqa: E731
    blocks = [(fastest(lambda r, i=i: r["blocks"][i][0]), fastest(lambda r, i=i: r["blocks"][i][1]))
              for i in range(len(runs[0]["blocks"]))]
    return {"blocks": blocks, "whole": (fastest(lambda r: r["whole"][0]), fastest(lambda r: r["whole"][1])),
            "optimizer": fastest(lambda r: r["optimizer"])}


def _compute_once(cfg: GPTConfig, tokens: torch.Tensor) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randn(BATCH, cfg.block_size, cfg.n_embd, requires_grad=True)
    blocks = []
    for block in model.blocks:
        t0 = time.perf_counter()
        out = block(x)
        t1 = time.perf_counter()
        out.sum().backward()
        blocks.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
    t0 = time.perf_counter()
    loss = model(tokens[:, :-1], tokens[:, 1:])
    t1 = time.perf_counter()
    loss.backward()
    whole = ((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()  # the state is created here, not timed
    return {"blocks": blocks, "whole": whole, "optimizer": _ms(opt.step)}


def fsdp_model(cfg: GPTConfig):
    from minddp.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def rank_main(rank: int, world_size: int, args: dict, out_path: str) -> None:
    torch.set_num_threads(1)
    cfg = GPTConfig()
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size + 1), generator=torch.Generator().manual_seed(rank))
    model, opt = fsdp_model(cfg)

    def step():
        opt.zero_grad()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()

    for _ in range(3):
        step()
    fit = {n: [] for n in FIT_SIZES}
    profiles, measured, local = [], {"prefetch": [], "no prefetch": []}, []
    for _ in range(args["rounds"]):
        for n in FIT_SIZES:
            fit[n].append(halves_ms(n, world_size))
        profiles.append(compute_profile(cfg, tokens))
        with collectives_made_local(True):
            dist.barrier()
            local.append(_ms(step, args["steps"]))
        for name, prefetch in (("prefetch", True), ("no prefetch", False)):
            model.set_prefetch(prefetch)
            dist.barrier()
            measured[name].append(_ms(step, args["steps"]))
        model.set_prefetch(True)
    result = {"fit_ms": {n: statistics.median(_slowest(v)) for n, v in fit.items()},
              "measured_ms": {k: _slowest(v) for k, v in measured.items()}, "local_ms": _slowest(local),
              "profiles": profiles, "unit_numel": _unit_numel(cfg)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def _unit_numel(cfg: GPTConfig) -> list[int]:
    model = GPT(cfg)
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    return [sum(p.numel() for p in model.parameters()) - sum(blocks), *blocks]  # the root first


def predict(raw: dict, world_size: int) -> dict:
    sizes = sorted(int(n) for n in raw["fit_ms"])
    link = fit_link(sizes, [2 * raw["fit_ms"][str(n)] / 1e3 for n in sizes], world_size, "this machine (fitted)")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    blocks = [(med([p["blocks"][i][0] for p in raw["profiles"]]), med([p["blocks"][i][1] for p in raw["profiles"]]))
              for i in range(len(raw["profiles"][0]["blocks"]))]
    whole = (med([p["whole"][0] for p in raw["profiles"]]), med([p["whole"][1] for p in raw["profiles"]]))
    root = (max(0.0, whole[0] - sum(b[0] for b in blocks)), max(0.0, whole[1] - sum(b[1] for b in blocks)))
    optimizer = med([p["optimizer"] for p in raw["profiles"]])
    # The profiles split the compute among the units; the step with its collectives made local says how much.
    profiled = sum(whole) + optimizer / world_size
    scale = med(raw["local_ms"]) / profiled
    numel = raw["unit_numel"]
    units = [Unit("root", 4 * numel[0], 4 * numel[0], *(scale * t for t in root))]
    units += [Unit(f"block {i}", 4 * n, 4 * n, *(scale * t for t in blocks[i])) for i, n in enumerate(numel[1:])]
    optimizer *= scale
    rows = []
    for name, prefetch in (("prefetch", True), ("no prefetch", False)):
        ms = raw["measured_ms"][name]
        row = {"case": name, "measured_ms": med(ms), "min_ms": min(ms), "max_ms": max(ms)}
        for mode, overlap in (("overlap", True), ("shared", False)):
            step = simulate_stage3(units, link, world_size, optimizer,
                                   Stage3Policy(prefetch=prefetch, overlap=overlap, keep_last=True, keep_root=True))
            row[f"{mode}_ms"], row[f"{mode}_error"] = step.step_ms, step.step_ms / row["measured_ms"] - 1
            row[f"{mode}_error_fastest"] = step.step_ms / row["min_ms"] - 1
            row["comm_ms"], row["compute_ms"] = step.comm_ms, step.work_ms + step.optimizer_ms
        rows.append(row)
    return {"alpha_us": link.alpha_s * 1e6, "bandwidth_MBps": link.bandwidth_Bps / 1e6, "rows": rows,
            "fit_ms": raw["fit_ms"], "profiled_ms": profiled, "local_ms": med(raw["local_ms"])}


def table(result: dict, world_size: int, rounds: int) -> str:
    lines = [f"minddp.fsdp on minddp_lab.models.GPT (each block, then the root), AdamW, {world_size} ranks, Gloo, CPU, "
             f"1 thread per rank; medians over {rounds} rounds",
             "network fitted to minddp.fsdp's all-gather and reduce-scatter alone, each after a little compute: "
             f"alpha = {result['alpha_us']:.1f} us per ring step, bandwidth = {result['bandwidth_MBps']:.0f} MB/s",
             "compute: each figure the fastest of 3 in its round, then the median over rounds, scaled to the step "
             f"with its collectives made local ({result['local_ms']:.1f} ms; the profiles add up to "
             f"{result['profiled_ms']:.1f}); error against the measured median (and against the fastest round)",
             "", "| case | compute ms (model) | comm ms (model) | measured ms (min-max) | predicted overlap | error "
             "| predicted shared cores | error |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['case']} | {r['compute_ms']:.1f} | {r['comm_ms']:.1f} | {r['measured_ms']:.1f} "
                     f"({r['min_ms']:.1f}-{r['max_ms']:.1f}) | {r['overlap_ms']:.1f} | {r['overlap_error']:+.0%} "
                     f"({r['overlap_error_fastest']:+.0%}) | {r['shared_ms']:.1f} | {r['shared_error']:+.0%} "
                     f"({r['shared_error_fastest']:+.0%}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--quick", action="store_true", help="2 rounds of 1 step: a smoke test")
    p.add_argument("--json")
    p.add_argument("--text")
    a = p.parse_args(argv)
    args = {"rounds": 2 if a.quick else a.rounds, "steps": 1 if a.quick else a.steps}
    load_before = os.getloadavg()[0]
    raw = ranks_json(rank_main, a.world_size, args)
    result = predict(raw, a.world_size)
    text = table(result, a.world_size, args["rounds"])
    text += f"\nload average (1 min) {load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after"
    emit(text, a.text, a.json, {"args": args, **result, "raw": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
