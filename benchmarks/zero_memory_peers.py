"""Stage 2's gradient memory at its peak, beside DeepSpeed's stage 2, in one run.

    python benchmarks/zero_memory_peers.py                       # N = 2 and 4, CPU, Gloo
    PYTHONPATH=.:DEEPSPEED_DIR DS_ACCELERATOR=cpu python benchmarks/zero_memory_peers.py  # with DeepSpeed 0.19.8 in DEEPSPEED_DIR

Two tables. The first (``--table defaults``): stage 2 at minddp's
defaults (``MiniDDP(model)``, 25 MB buckets) on ``minddp_lab.models.GPT()`` and
the 10.9 M GPT below, beside DeepSpeed's stage 2 with its reduce bucket the
size of the model (and, once, at its default 5e8 elements), every setup in
rank processes of its own under :class:`live_bytes.LiveBytes` from before
the model exists: the peak of model state and of every storage in the third
of five steps, the parts held after its backward, what is alive between
steps, and whether the parameters equal the first row's after five steps.
A row "copied at launch" sets the pool's ``slots_at_hook`` off: each
``.grad`` copied into its bucket when the bucket is complete. (Its code:
``benchmarks/benchlib/zero_defaults.py``.)

The second (``--table tuned``): one spawned job per (setup, world size), on ``minddp_lab.models.GPT`` grown to
~10.8 M parameters (n_embd 384, 6 blocks), AdamW, 4 MB buckets (DeepSpeed:
``reduce_bucket_size`` of 1 M elements, contiguous gradients, no clipping,
``overlap_comm`` off, and on in a second row). Three steps; the third is
measured:

Setups: MiniDDP with bucket views (the least DDP holds: one copy of the
gradients); stage 2 with copied gradients, with bucket views (the analogue
of DeepSpeed's contiguous gradients), and with bucket views and
``overlap_comm=False`` (as DeepSpeed's first row: each bucket reduced
before the next is filled). Like with like: stage 2 with views beside
DeepSpeed's overlap row (both double-buffer), no overlap beside no overlap.

* **profiler**: the most bytes allocated at once during the backward above
  its start (torch's profiler, every op's own allocations and frees in time
  order: :func:`minddp.zero.memory.allocation_peak`), plus the gradient bytes already held when it starts (minddp:
  stage 2's pool; DeepSpeed allocates its buckets during backward). Counted
  the same way for every setup, activations' gradients included;
* **tracked** (minddp only): :class:`minddp.zero.memory.GradientPeak`,
  ``.grad`` + bucket buffers or pool + shard gradients, sampled at every
  gradient hook and bucket launch.

Each figure is the maximum over ranks; with ``--repeats R``, the lowest of
R runs, followed by how much higher the highest was (DeepSpeed's peak moves
with timing by a few MiB from run to run; minddp's does not). DeepSpeed is optional: without it
the script says so and measures minddp alone. Never a dependency: install it
aside (``pip install --no-deps --target DIR deepspeed==0.19.8`` plus hjson,
ninja, py-cpuinfo, msgpack, psutil, pydantic (and pydantic-core,
annotated-types, typing-inspection), einops, tqdm).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minddp.launch import spawn  # noqa: E402
from benchlib.zero_defaults import DEFAULT_SETUPS, defaults_table  # noqa: E402

SETUPS = ("minddp DDP, bucket views", "minddp stage 2", "minddp stage 2, views", "minddp stage 2, no overlap",
          "DeepSpeed stage 2, no overlap", "DeepSpeed stage 2, overlap")
CAP_MB = 4.0
MiB = 2 ** 20


def config():
    from minddp_lab.models import GPTConfig

    return GPTConfig(n_embd=384, n_layer=6, n_head=6)


def rank_main(rank: int, world_size: int, setup: str, out_dir: str) -> None:
    import torch.distributed as dist

    from minddp import MiniDDP
    from minddp_lab.models import GPT
    from minddp.zero import ZeroRedundancyOptimizer
    from minddp.zero.memory import GradientPeak, allocation_peak, gradient_bytes

    torch.set_num_threads(1)
    cfg = config()
    torch.manual_seed(0)
    module = GPT(cfg)
    tracker = None
    if setup.startswith("DeepSpeed"):
        import deepspeed

        os.environ.setdefault("LOCAL_RANK", str(rank))
        ds_config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                     "zero_optimization": {"stage": 2, "reduce_bucket_size": int(CAP_MB * MiB / 4),
                                           "allgather_bucket_size": int(CAP_MB * MiB / 4),
                                           "overlap_comm": setup == "DeepSpeed stage 2, overlap",
                                           "contiguous_gradients": True}}
        engine, opt, _, _ = deepspeed.initialize(model=module, config=ds_config,
                                                 optimizer=torch.optim.AdamW(module.parameters(), lr=1e-3))
        forward, backward, step, model = engine, engine.backward, engine.step, engine
    else:
        tracker = GradientPeak(module)
        as_view = "views" in setup or "no overlap" in setup
        model = MiniDDP(module, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=as_view)
        if "DDP" in setup:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, ddp=model, lr=1e-3,
                                          shard_gradients=True, overlap_comm="no overlap" not in setup)
        tracker.watch(model, opt)
        forward, backward, step = model, (lambda loss: loss.backward()), opt.step
    g = torch.Generator().manual_seed(rank)
    result = {}
    for i in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=g)
        if tracker is not None:
            opt.zero_grad(set_to_none=True)
        loss = forward(tokens[:, :-1], tokens[:, 1:])
        if i < 2:
            backward(loss)
        else:
            held = gradient_bytes(model, opt) if tracker is not None else \
                sum(p.grad.nbytes for p in module.parameters() if p.grad is not None)
            if tracker is not None:
                tracker.reset()
            result["profiler"] = held + allocation_peak(lambda: backward(loss))[0]
            if tracker is not None:
                tracker.sample()
                result["tracked"] = tracker.peak
                pool = getattr(opt, "bucket_pool", None)
                result["pool"] = pool.nbytes if pool is not None else 0
        step()
    result["psi"] = sum(p.numel() for p in module.parameters())
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--table", choices=("defaults", "tuned", "both"), default="both",
                        help="defaults: stage 2 at minddp's defaults beside DeepSpeed (GPT() and 10.9 M); "
                             "tuned: the 10.9 M GPT with 4 MB buckets, every mode")
    parser.add_argument("--only", default="", help="measure only the setups whose name contains this")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each setup this many times and print its lowest peak (+ how much higher the "
                             "highest was): a peak that depends on timing is taken at its best")
    args = parser.parse_args(argv)
    setups = list(SETUPS)
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any failure to import means: measure without it
        print(f"DeepSpeed not available ({type(error).__name__}: {error}); measuring minddp alone")
        setups = [s for s in setups if not s.startswith("DeepSpeed")]
    world_sizes = [int(n) for n in args.world_sizes.split(",")]
    if args.table in ("defaults", "both"):
        with_deepspeed = any(s.startswith("DeepSpeed") for s in setups)
        defaults_table(world_sizes, [s for s in DEFAULT_SETUPS if (with_deepspeed or not s.startswith("DeepSpeed"))
                                     and args.only in s])
    setups = [s for s in setups if args.only in s]
    if args.table == "defaults":
        return 0
    print(f"GPT(n_embd=384, n_layer=6), AdamW fp32, {CAP_MB:g} MB buckets; MiB per rank (max over ranks), "
          "peak during the third backward")
    spread = 7 if args.repeats > 1 else 0
    print(f"{'setup':<30}" + "".join(f"{f'N={n} profiler':>16}{'tracked':>9}{'pool':>7}{'':{spread}}"
                                     for n in world_sizes))
    for setup in setups:
        row = f"{setup:<30}"
        for n in world_sizes:
            runs = []
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory() as tmp:
                    spawn(rank_main, n, setup, tmp, backend="gloo")
                    results = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(n)]
                runs.append({k: max(r.get(k, 0) for r in results) for k in ("profiler", "tracked", "pool")})
            best = min(runs, key=lambda run: run["profiler"])
            row += f"{best['profiler'] / MiB:>16.1f}" + (f"{best['tracked'] / MiB:>9.1f}{best['pool'] / MiB:>7.1f}"
                                                         if "tracked" in results[0] else f"{'-':>9}{'-':>7}")
            spread = max(run["profiler"] for run in runs) - best["profiler"]
            row += f" (+{spread / MiB:.1f})" if args.repeats > 1 else ""
        print(row, flush=True)
    print(f"psi = {results[0]['psi']:,} parameters: 4 psi = {4 * results[0]['psi'] / MiB:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
