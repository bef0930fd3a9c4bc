"""``python -m minddp_lab.simulate zero``: memory and step time of DDP, ZeRO stages 1, 2 and 3, per rank.

    python -m minddp_lab.simulate zero                                  # 7.5b on dgx-h100, 8 to 1,024 ranks
    python -m minddp_lab.simulate zero --model gpt2-xl --network ib400 --world 8,64
    python -m minddp_lab.simulate zero --model 13e9 --precision fp32 --tflops 100
    python -m minddp_lab.simulate zero --no-prefetch                    # stage 3 without prefetching the next unit

One row per world size; for each setup the paper's bytes per rank (GB =
1e9 bytes; parameters, gradients and optimizer state, no activations), the
simulated step time, and the bytes each rank sends per step. Stage 3's
bytes add its working set (the units held in full at once). The models
behind the numbers are in the docstrings of :mod:`minddp_lab.simulate.zero` and
:mod:`minddp_lab.simulate.stage3`.
"""

from __future__ import annotations

import argparse
import sys

from minddp_lab.network import HIERARCHIES, PRESETS, get_network
from minddp_lab.simulate.arguments import OneLineParser, listed, positive, whole
from minddp_lab.simulate.replay import DDPPolicy
from minddp_lab.simulate.stage3 import Stage3Policy, working_set_bytes
from minddp_lab.simulate.zero import MODELS, PRECISIONS, SETUPS, Compute, get_model, predict, profile_for, units_for

__all__ = ["main", "format_zero_table"]

# DeepSpeed's reduce_bucket_size default, 5e8 elements, in MiB of fp16.
DEEPSPEED_BUCKET_MB = 5e8 * 2 / 2**20
TITLES = {"ddp": "DDP", "stage1": "stage 1", "stage2": "stage 2", "stage3": "stage 3"}


def format_zero_table(rows: list[tuple[int, dict]]) -> str:
    """``rows``: (world size, {setup: (bytes per rank, ZeroStep)}) -> a markdown table."""
    head = ["ranks"] + [f"{TITLES[s]} {c}" for s in SETUPS for c in ("GB/rank", "step ms", "wire GB")]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("-" * (len(h) + 1) + ":" for h in head) + "|"]
    for world, by_setup in rows:
        cells = [f"{world:,}"]
        for s in SETUPS:
            memory, step = by_setup[s]
            cells += [f"{memory / 1e9:.1f}", f"{step.step_ms:,.0f}", f"{step.wire_bytes / 1e9:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m minddp_lab.simulate zero", description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="7.5b", help=f"one of: {', '.join(MODELS)}, or a parameter count like 13e9 "
                   "(default %(default)s)")
    p.add_argument("--network", default="dgx-h100", help=f"one of: {', '.join([*PRESETS, *HIERARCHIES])} "
                   "(default %(default)s)")
    p.add_argument("--world", type=listed(whole), default=[8, 64, 512, 1024],
                   help="world sizes, comma-separated (default 8,64,512,1024)")
    p.add_argument("--precision", choices=list(PRECISIONS), default="mixed",
                   help="mixed: the paper's 2+2+12 bytes per parameter; fp32: 4+4+8, as minddp measures")
    p.add_argument("--bucket-mb", type=positive, default=DEEPSPEED_BUCKET_MB,
                   help="bucket cap in MiB (default %(default).0f: DeepSpeed's reduce_bucket_size, 5e8 fp16 elements)")
    p.add_argument("--tflops", type=positive, default=Compute.tflops, help="achieved TFLOPS per rank (default %(default)g)")
    p.add_argument("--no-prefetch", action="store_true",
                   help="stage 3 gathers each unit only when it is needed (default: the next unit is prefetched)")
    p.add_argument("--tokens", type=whole, default=Compute.tokens_per_rank, help="tokens per rank per step "
                   "(default %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model, network = get_model(args.model), get_network(args.network)
        if min(args.world, default=0) < 1:
            raise ValueError(f"world sizes must be >= 1, got {args.world}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    compute = Compute(tflops=args.tflops, tokens_per_rank=args.tokens)
    policy = DDPPolicy(bucket_cap_mb=args.bucket_mb)
    profile = profile_for(model, compute, args.precision)
    p, g, k, _ = PRECISIONS[args.precision]
    print(f"model: {model.name}, {model.params:.4g} parameters: {model.source}")
    print(f"precision: {args.precision}, bytes per parameter: {p} weights + {g} gradients + {k} optimizer state")
    print(f"compute per rank: {compute.tflops:g} TFLOPS achieved, {compute.tokens_per_rank:,} tokens per step: "
          f"forward {profile.forward_ms:,.0f} ms, backward {profile.backward_ms:,.0f} ms, "
          f"unsharded optimizer step {profile.after_backward_ms:,.0f} ms")
    print(f"network: {network.name}: {network.source}")
    print(f"buckets: {args.bucket_mb:.0f} MiB; step ms = forward + backward with the bucket reductions + "
          "optimizer (1/N under ZeRO) + the parameters' all-gather (stages 1, 2)")
    stage3 = Stage3Policy(prefetch=not args.no_prefetch)
    units = units_for(model, compute, args.precision)
    print(f"stage 3: {len(units)} units (one per layer), each all-gathered before its forward and its backward and "
          f"reduce-scattered after it, {'the next one prefetched' if stage3.prefetch else 'no prefetch'}; "
          f"working set {working_set_bytes(units, stage3) / 1e9:.2f} GB "
          f"({2 if stage3.prefetch else 1} unit(s) of full parameters and gradients)")
    print("memory: the ZeRO paper's formula (stage 3: plus its working set), GB = 1e9 bytes, no activations or "
          "buffers; wire: bytes each rank sends per step (rings)")
    rows = [(n, {s: predict(model, network, n, s, precision=args.precision, compute=compute, policy=policy,
                            stage3=stage3) for s in SETUPS}) for n in args.world]
    print(format_zero_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
