"""Stage 2 at minddp's defaults beside DeepSpeed's stage 2: the first table of
``benchmarks/zero_memory_peers.py``.

Each setup in rank processes of its own under :class:`live_bytes.LiveBytes`
from before the model exists: the peak of model state and of every storage in
the third of five steps, the parts held after its backward, what is alive
between steps, and whether the parameters equal the first row's after five
steps. DeepSpeed's reduce buckets travel by its own shared-memory transport on
CPU, which no ``c10d`` operation sees: they are marked as state by hand.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

from minddp.launch import spawn

MiB = 2 ** 20
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

    from benchlib.live_bytes import LiveBytes
    from minddp import MiniDDP
    from minddp_lab.models import GPT, GPTConfig
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
            if "at launch" in setup:  # the other mode: a bucket's .grad copied in when it is complete
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
          "state, communication buffers, anything alive between steps; benchmarks/benchlib/live_bytes.py); all: every "
          "storage, activations included; between: alive when the step ended; parts: held after backward; "
          "params: bit-equal to the first row after 5 steps")
