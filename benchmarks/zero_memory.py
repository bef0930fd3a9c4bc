"""Bytes per rank for DDP, ZeRO stage 1 and stage 2, beside the ZeRO paper's formulas; bytes on the wire.

    python benchmarks/zero_memory.py                      # CPU, Gloo, world sizes 1..4 (docs/zero_memory.txt)
    python benchmarks/zero_memory.py --world-sizes 1,2 --device cuda --backend nccl

One spawned job per (setup, world size): MiniDDP on ``minddp_lab.models.GPT``
(the default GPTConfig) with AdamW, plain (DDP) or wrapped in
``minddp.zero.ZeroRedundancyOptimizer`` (stage 1, or stage 2 with
``shard_gradients=True``). Two steps; the second is measured (stage 2's
first backward is all-reduced: MiniDDP rebuilds its buckets after it).

Per rank, at three points (after construction, before the second step,
after it): bytes of parameters, gradients (``.grad`` and ZeRO's shard
gradients), optimizer state, ZeRO's flat copy of its parameter shard, and
MiniDDP's bucket buffers, counted from the tensors themselves
(:func:`minddp.zero.memory.measured_bytes`); on a GPU also
``torch.cuda.max_memory_allocated``. Each figure is the maximum over ranks
(an uneven partition would show), beside the paper's formula for fp32
AdamW (4 bytes of parameter, 4 of gradient, K = 8 of state per parameter).

Bytes on the wire: a counting wrapper around the collectives records each
call of the measured step; a ring algorithm sends ``2 (N-1)/N`` of an
all-reduced buffer per rank, and ``(N-1)/N`` of a reduce-scattered or
all-gathered one. Not timed: several ranks on few cores are fine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minddp.launch import spawn  # noqa: E402

SETUPS = ("ddp", "stage1", "stage2")
POINTS = ("after construction", "before step", "after step")
CATEGORIES = ("params", "grads", "optimizer_state", "shard_params", "bucket_buffers")


class WireCounter:
    """Wraps torch.distributed's collectives; sums, per kind, the bytes each call moves per rank (ring)."""

    KINDS = {"all_reduce": 2.0, "reduce_scatter_tensor": 1.0, "reduce_scatter_single": 1.0,
             "all_gather_into_tensor": 1.0, "all_gather_single": 1.0, "broadcast": 1.0, "gather": 1.0}

    def __init__(self):
        self.sent: dict[str, float] = {}
        self.on = False
        for name, factor in self.KINDS.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._counting(name, factor, original))

    def _counting(self, name, factor, original):
        def call(*args, **kwargs):
            if self.on:
                n = dist.get_world_size(kwargs.get("group"))
                big = max((a for a in args if torch.is_tensor(a)), key=lambda t: t.numel())  # the full buffer
                kind = name.replace("_single", "").replace("_into_tensor", "").replace("_tensor", "")
                self.sent[kind] = self.sent.get(kind, 0.0) + factor * big.nbytes * (n - 1) / n
            return original(*args, **kwargs)
        return call


def rank_main(rank: int, world_size: int, setup: str, device: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    counter = WireCounter()  # before minddp.zero binds the collectives it uses
    from minddp import MiniDDP
    from minddp_lab.models import GPT, GPTConfig
    from minddp.zero import ZeroRedundancyOptimizer
    from minddp.zero.memory import measured_bytes

    dev = torch.device(device if device == "cpu" else f"cuda:{rank}")
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = MiniDDP(GPT(cfg).to(dev))
    if setup == "ddp":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, ddp=model,
                                      shard_gradients=setup == "stage2", lr=1e-3)
    report = {"numel": sum(p.numel() for p in model.parameters()), "points": {}, "peak": {}}

    def record(point):
        report["points"][point] = measured_bytes(model, opt)
        if dev.type == "cuda":
            report["peak"][point] = torch.cuda.max_memory_allocated(dev)

    record("after construction")
    g = torch.Generator().manual_seed(rank)
    for step in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=g).to(dev)
        counter.on = step == 1
        opt.zero_grad()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        if step == 1:
            record("before step")
        opt.step()
        counter.on = False
        if step == 1:
            record("after step")
    report["wire"] = counter.sent
    with open(os.path.join(out_dir, f"{setup}-{world_size}-{rank}.json"), "w") as f:
        json.dump(report, f)


def paper(setup: str, numel: int, n: int) -> float:
    from minddp.zero.memory import paper_bytes

    return paper_bytes(SETUPS.index(setup), numel, n, param_bytes=4, grad_bytes=4, state_bytes=8)


def table(results: dict, world_sizes: list[int]) -> str:
    mib = lambda b: f"{b / 2**20:7.2f}"
    numel = next(iter(results.values()))[0]["numel"]
    lines = [f"GPT (minddp_lab.models.GPTConfig defaults), psi = {numel:,} parameters, AdamW fp32; MiB per rank, "
             "max over ranks [min] 'before step' (everything alive: gradients and optimizer state)",
             "paper = fp32 formula: DDP (4+4+8)psi, stage 1 (4+4)psi + 8psi/N, stage 2 4psi + (4+8)psi/N",
             "model = params + grads + optimizer_state (what the formula counts); extra = ZeRO's shard copy "
             "of its parameters + MiniDDP's bucket buffers; after step = every category, after the step "
             "(ZeRO frees its shard gradients there)",
             "",
             f"{'N':>2} {'setup':<7} {'params':>8} {'grads':>8} {'opt state':>16} {'model':>8} {'paper':>8} "
             f"{'extra':>8} {'after step':>12} {'wire MiB/step':>14} {'2psi(N-1)/N':>12}"]
    for n in world_sizes:
        for setup in SETUPS:
            ranks = results[(setup, n)]
            at = [r["points"]["before step"] for r in ranks]
            after = [r["points"]["after step"] for r in ranks]
            top = {c: max(a[c] for a in at) for c in CATEGORIES}
            low_state = min(a["optimizer_state"] for a in at)
            model_bytes = max(a["params"] + a["grads"] + a["optimizer_state"] for a in at)
            after_total = max(sum(b[c] for c in CATEGORIES) for b in after)
            wire = max(sum(r["wire"].values()) for r in ranks)
            ideal = 2 * 4 * numel * (n - 1) / n
            lines.append(f"{n:>2} {setup:<7} {mib(top['params'])} {mib(top['grads'])} "
                         f"{mib(top['optimizer_state'])} [{mib(low_state)}] {mib(model_bytes)} "
                         f"{mib(paper(setup, numel, n))} {mib(top['shard_params'] + top['bucket_buffers'])} "
                         f"{mib(after_total):>12} {mib(wire):>14} {mib(ideal):>12}")
        lines.append("")
    lines.append("wire per kind (rank 0, MiB, ring): " + "; ".join(
        f"{setup} N={n}: " + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(results[(setup, n)][0]["wire"].items()))
        for n in world_sizes if n > 1 for setup in SETUPS))
    peaks = {k: [r["peak"] for r in v] for k, v in results.items() if v[0]["peak"]}
    for (setup, n), per_rank in sorted(peaks.items()):
        lines.append(f"cuda max_memory_allocated {setup} N={n}: " + ", ".join(
            f"{p}: {max(r[p] for r in per_rank) / 2**20:.2f} MiB" for p in POINTS))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="1,2,3,4")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--out", default=None, help="also write the table here")
    args = p.parse_args(argv)
    world_sizes = [int(n) for n in args.world_sizes.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in world_sizes:
            for setup in SETUPS:
                spawn(rank_main, n, setup, args.device, tmp, backend=args.backend)
                results[(setup, n)] = [json.load(open(os.path.join(tmp, f"{setup}-{n}-{r}.json"))) for r in range(n)]
                print(f"[zero_memory] {setup} N={n} done", file=sys.stderr, flush=True)
    text = table(results, world_sizes)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"$ python benchmarks/zero_memory.py --world-sizes {args.world_sizes} --device {args.device}\n"
                    + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
