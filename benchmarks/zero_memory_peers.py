"""Stage 2's gradient memory at its peak, beside DeepSpeed's stage 2, in one run.

    python benchmarks/zero_memory_peers.py                       # N = 2 and 4, CPU, Gloo
    PYTHONPATH=.:/work/deps/deepspeed DS_ACCELERATOR=cpu python benchmarks/zero_memory_peers.py  # with DeepSpeed 0.19.8

Two tables. The first (``--table defaults``, issue 39): stage 2 at minddp's
defaults (``MiniDDP(model)``, 25 MB buckets) on ``minddp.models.GPT()`` and
the 10.9 M GPT below, beside DeepSpeed's stage 2 with its reduce bucket the
size of the model (and, once, at its default 5e8 elements), every setup in
rank processes of its own under :class:`_live_bytes.LiveBytes` from before
the model exists: the peak of model state and of every storage in the third
of five steps, the parts held after its backward, what is alive between
steps, and whether the parameters equal the first row's after five steps.
A row "copied at launch" sets the pool's ``slots_at_hook`` off: each
``.grad`` copied into its bucket when the bucket is complete.

The second (``--table tuned``): one spawned job per (setup, world size), on ``minddp.models.GPT`` grown to
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
annotated-types, typing-inspection), einops, tqdm; see
/work/shared/reference/fsdp-facts.md).
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

SETUPS = ("minddp DDP, bucket views", "minddp stage 2", "minddp stage 2, views", "minddp stage 2, no overlap",
          "DeepSpeed stage 2, no overlap", "DeepSpeed stage 2, overlap")
CAP_MB = 4.0
MiB = 2 ** 20


def config():
    from minddp.models import GPTConfig

    return GPTConfig(n_embd=384, n_layer=6, n_head=6)


def rank_main(rank: int, world_size: int, setup: str, out_dir: str) -> None:
    import torch.distributed as dist

    from minddp import MiniDDP
    from minddp.models import GPT
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


# ---------------------------------------------------------------- at the defaults (issue 39)
MODELS = {"GPT()": {}, "GPT 10.9 M": {"n_embd": 384, "n_layer": 6, "n_head": 6}}
DEFAULT_SETUPS = ("minddp stage 2, defaults", "minddp stage 2, copied at launch", "DeepSpeed stage 2, bucket = model",
                  "DeepSpeed stage 2, its defaults")
PARTS = ("params", "grads", "optimizer state", "master shard", "buffers")
STEPS, MEASURED = 5, 2  # five steps (parameters compared after them), the third one measured


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _parts_minddp(module, opt) -> dict:
    """This rank's bytes by part, after backward: MiniDDP and stage 2 (lent pool buffers are buckets')."""
    from minddp.zero.memory import measured_bytes

    held = measured_bytes(opt.ddp, opt)
    return {"params": held["params"], "grads": held["grads"], "optimizer state": held["optimizer_state"],
            "master shard": held["shard_params"], "buffers": held["bucket_buffers"]}


def _ipg_buffers(opt) -> list[torch.Tensor]:
    """DeepSpeed's reduce buckets (``ipg_buckets``), allocated during backward and freed at its end."""
    return [b for bucket in getattr(opt, "ipg_buckets", {}).values() for b in bucket.buffer]


def _parts_deepspeed(module, engine) -> dict:
    """The same parts, from DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer`` (stage 1 and 2)."""
    opt = engine.optimizer
    grads = [p.grad for p in module.parameters()] + [getattr(opt, "grads_in_partition", None)]
    grads += [g for gs in opt.averaged_gradients.values() if gs is not None for g in gs]
    buffers = _ipg_buffers(opt)
    state = [v for st in opt.optimizer.state.values() for v in st.values()]
    return {"params": _unique_bytes(module.parameters()), "grads": _unique_bytes(grads),
            "optimizer state": _unique_bytes(state), "master shard": _unique_bytes(opt.single_partition_of_fp32_groups),
            "buffers": _unique_bytes(buffers)}


def defaults_main(rank: int, world_size: int, setup: str, model_name: str, out_dir: str) -> None:
    """Five steps under :class:`LiveBytes` (every storage, from before the model exists); the third measured:
    its peak of model state and of everything, and the parts held after its backward."""
    import torch.distributed as dist

    from _live_bytes import LiveBytes
    from minddp import MiniDDP
    from minddp.models import GPT, GPTConfig
    from minddp.zero import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    cfg = GPTConfig(**MODELS[model_name])
    g = torch.Generator().manual_seed(rank)
    result = {}
    with LiveBytes() as live:
        torch.manual_seed(0)
        module = GPT(cfg)
        psi = sum(p.numel() for p in module.parameters())
        if setup.startswith("DeepSpeed"):
            import deepspeed

            os.environ.setdefault("LOCAL_RANK", str(rank))
            zero = {"stage": 2}
            if "bucket = model" in setup:
                zero.update(reduce_bucket_size=psi, allgather_bucket_size=psi)
            ds_config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": zero}
            engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config,
                                                   optimizer=torch.optim.AdamW(module.parameters(), lr=1e-3))
            forward, backward, step, zero_grad = engine, engine.backward, engine.step, (lambda: None)
            parts = lambda: _parts_deepspeed(module, engine)
            for p in module.parameters():  # its buckets travel by its own shared-memory op on CPU, not c10d
                p.register_post_accumulate_grad_hook(lambda _: live.mark_state(_ipg_buffers(engine.optimizer)))
        else:
            model = MiniDDP(module)
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, ddp=model, lr=1e-3,
                                          shard_gradients=True)
            forward, backward, step = model, (lambda loss: loss.backward()), opt.step
            zero_grad = lambda: opt.zero_grad(set_to_none=True)
            if "at launch" in setup:  # as before issue 39: a bucket's .grad copied in when it is complete
                opt.bucket_pool.slots_at_hook = False
            parts = lambda: _parts_minddp(module, opt)
        live.watch_parameters(module)
        for i in range(STEPS):
            tokens = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=g)
            zero_grad()
            if i == MEASURED:
                live.reset_peak()
            backward(forward(tokens[:, :-1], tokens[:, 1:]))
            if i == MEASURED:
                result["parts"] = parts()
            step()
            if i == MEASURED:
                result.update(peak_state=live.peak_state, peak_all=live.peak, between=live.current)
    result["psi"] = psi
    torch.save([p.detach().clone() for p in module.parameters()], os.path.join(out_dir, f"{rank}.pt"))
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()


def defaults_table(world_sizes: list[int], setups: list[str]) -> None:
    """Stage 2 at minddp's defaults beside DeepSpeed's stage 2: per model and N, MiB per rank (max over ranks)."""
    print("Stage 2 at its defaults: MiniDDP(model) + ZeroRedundancyOptimizer(..., shard_gradients=True) beside "
          "DeepSpeed 0.19.8 stage 2 (reduce bucket = the model's size, or its default 5e8 elements); AdamW fp32, "
          f"{STEPS} steps, the third measured; MiB per rank, max over ranks")
    head = "".join(f"{p:>9}" for p in ("params", "grads", "opt", "master", "buffers")) + \
        f"{'between':>9}{'PEAK':>9}{'all':>9}  params"
    print(f"{'model':<11}{'N':>2} {'setup':<34}{head}")
    for model_name in MODELS:
        for n in world_sizes:
            reference = None
            for setup in setups:
                if setup.endswith("its defaults") and (model_name != "GPT()" or n != 2):
                    continue  # a 2 GB bucket per rank: once, for the record
                with tempfile.TemporaryDirectory() as tmp:
                    spawn(defaults_main, n, setup, model_name, tmp, backend="gloo")
                    results = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(n)]
                    params = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(n)]
                reference = reference or params
                equal = all(torch.equal(a, b) for mine, ref in zip(params, reference) for a, b in zip(mine, ref))
                top = lambda key: max(r[key] for r in results) / MiB
                row = "".join(f"{max(r['parts'][p] for r in results) / MiB:>9.2f}" for p in PARTS)
                row += f"{top('between'):>9.2f}{top('peak_state'):>9.2f}{top('peak_all'):>9.2f}"
                print(f"{model_name:<11}{n:>2} {setup:<34}{row}  {'equal' if equal else 'DIFFER'}", flush=True)
    print("PEAK: the most bytes of model state alive at once in the measured step (parameters, gradients, optimizer "
          "state, communication buffers, anything alive between steps; benchmarks/_live_bytes.py); all: every "
          "storage, activations included; between: alive when the step ended; parts: held after backward; "
          "params: bit-equal to the first row after 5 steps")


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
