"""ZeRO stage 2 saves memory at minddp's defaults, on a model whose buckets are uneven.

``minddp_lab.models.GPT()`` (0.95 M parameters) under ``MiniDDP(model)`` with
every default: a 1 MB first bucket, then one 25 MB bucket that holds the
rest (2.6 MiB). Before this issue the pool kept two buffers the size of the
largest bucket between steps (5.3 MiB, more than the model's gradients),
and a bucket's ``.grad`` lived beside its buffer until the bucket was
complete. Checked on every rank, in the third step:

* between steps a rank holds what the optimizer needs and nothing else:
  every tensor storage Python can reach adds up to the parameters, the
  optimizer state and the master shard (no bucket buffer, no shard
  gradient kept alive by a finished reduce-scatter);
* after backward, gradient bytes are the shard gradients only (4 psi / N,
  plus one padding per bucket): no buffer is kept;
* during backward, the gradient bytes never exceed the shard gradients, the
  two buckets that may be in flight at once (each buffer the size of its own
  bucket) and one gradient not yet in its bucket: a gradient goes into its
  bucket at its hook, as DeepSpeed's do, not when its bucket is complete;
* the parameters equal stage 1's bit for bit.
"""

import gc

import pytest
import torch

from minddp import MiniDDP
from minddp_lab.models import GPT, GPTConfig
from minddp_lab.rank_pool import RankPool
from minddp.zero import ZeroRedundancyOptimizer
from minddp.zero.memory import GradientPeak, gradient_bytes, optimizer_state_bytes

MiB = 2 ** 20


@pytest.fixture(scope="module")
def fresh_ranks():
    """Ranks of their own: these tests count every tensor a rank can reach, and the suite's shared
    ranks keep what earlier tests left behind in their processes."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


def _storage_bytes_reachable() -> int:
    """Every tensor storage Python can reach now, each counted once."""
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.device.type != "meta" and obj.layout == torch.strided:
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _padded_bytes(bucket, world_size: int) -> int:
    return -(-bucket.numel // world_size) * world_size * bucket.dtype.itemsize


def _train(rank, world_size, stage):
    torch.set_num_threads(1)
    cfg = GPTConfig()
    torch.manual_seed(0)
    module = GPT(cfg)
    peak = GradientPeak(module)  # before MiniDDP's hooks: it sees each fresh .grad beside the bucket
    model = MiniDDP(module)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, ddp=model, lr=1e-3,
                                  shard_gradients=stage == 2)
    peak.watch(model, opt)
    g = torch.Generator().manual_seed(rank)
    out = {}
    for step in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=g)
        opt.zero_grad(set_to_none=True)
        peak.reset()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        out["after backward"] = peak.sample()
        opt.step()
    del tokens
    out["peak"] = peak.peak
    params = list(module.parameters())
    out["params"] = [p.detach().clone() for p in params]
    needed = sum(p.nbytes for p in params) + optimizer_state_bytes(opt) + \
        sum(s.master.untyped_storage().nbytes() for s in opt.layout.shards)
    out["between steps"] = _storage_bytes_reachable() - sum(t.nbytes for t in out["params"])
    out["needed"] = needed
    out["psi"] = sum(p.numel() for p in params)
    buckets = model.reducer.buckets
    padded = [_padded_bytes(b, world_size) for b in buckets]
    out["two buckets"] = max(a + b for a, b in zip(padded, padded[1:] + [0]))
    out["padding"] = sum(padded) - 4 * out["psi"]
    out["largest gradient"] = max(p.nbytes for p in params)
    out["pool"] = opt.bucket_pool.nbytes if stage == 2 else 0
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage2_keeps_nothing_bucket_sized_between_steps(fresh_ranks, world_size):
    for r in fresh_ranks(world_size).run(_train, 2, timeout_s=180):
        extra = r["between steps"] - r["needed"]
        assert extra == 0, f"N={world_size}: between steps a rank holds {extra / MiB:.2f} MiB beyond parameters, " \
                           f"optimizer state and master shard (pool: {r['pool'] / MiB:.2f} MiB)"


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage2_after_backward_holds_only_the_shard_gradients(fresh_ranks, world_size):
    for r in fresh_ranks(world_size).run(_train, 2, timeout_s=180):
        bound = 4 * r["psi"] / world_size + r["padding"]
        assert r["after backward"] <= bound, \
            f"N={world_size}: {r['after backward'] / MiB:.2f} MiB of gradients after backward, " \
            f"more than the shard gradients ({bound / MiB:.2f} MiB)"


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage2_gradients_go_into_their_bucket_at_their_hook(fresh_ranks, world_size):
    for r in fresh_ranks(world_size).run(_train, 2, timeout_s=180):
        bound = 4 * r["psi"] / world_size + r["padding"] + r["two buckets"] + r["largest gradient"]
        assert r["peak"] <= bound, \
            f"N={world_size}: {r['peak'] / MiB:.2f} MiB of gradients at the peak of backward, more than the " \
            f"shard gradients + two buckets + one gradient ({bound / MiB:.2f} MiB)"


def test_stage2_at_defaults_equals_stage1_bit_for_bit(fresh_ranks):
    pool = fresh_ranks(2)
    for one, two in zip(pool.run(_train, 1, timeout_s=180), pool.run(_train, 2, timeout_s=180)):
        for p, q in zip(one["params"], two["params"]):
            assert torch.equal(p, q), "stage 2 at its defaults differs from stage 1"
