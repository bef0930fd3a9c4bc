"""FSDP2's recipe, step by step, on ``minddp.fsdp.fully_shard`` and on torch's, side by side.

The recipe (PyTorch's own FSDP2 example runs it): build the model under
``torch.device("meta")``, ``fully_shard`` each block then the root,
``model.to_empty(device=...)``, ``reset_parameters()``; train with torch's
``clip_grad_norm_``; checkpoint with ``torch.distributed.checkpoint``'s
state-dict helpers (full and sharded) and ``dcp.save`` / ``dcp.load``; resume.
Two ranks, the same seed on both. Both shard rows as ``Shard(0)`` DTensors,
so ``nn.init`` draws the same values into the same rows and every step does
the same float32 arithmetic: losses, norms and checkpoints agree to the bit
(a reduction order that differed would show as a few ulps, hence ``rtol``).
"""

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

from minddp.fsdp import fully_shard as minddp_fully_shard

SHARDERS = {"torch": torch_fully_shard, "minddp": minddp_fully_shard}
VOCAB, WIDTH = 11, 6  # 11 rows over 2 ranks: 6 and 5, the uneven split Shard(0) pads


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 3 * WIDTH)
        self.down = nn.Linear(3 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))

    def reset_parameters(self):
        for layer in (self.norm, self.up, self.down):
            layer.reset_parameters()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def reset_parameters(self):
        self.embed.reset_parameters()
        for block in self.blocks:
            block.reset_parameters()
        self.head.reset_parameters()


def sharded_on_meta(shard):
    with torch.device("meta"):
        model = Tiny()
    for block in model.blocks:
        shard(block)
    return shard(model)


def train(model, optimizer, steps, first_step, rank):
    losses, norms = [], []
    for step in range(first_step, first_step + steps):
        tokens = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(1, 1).flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5).full_tensor().item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _recipe(rank, world_size, flavour, directory):
    torch.set_num_threads(1)
    shard = SHARDERS[flavour]
    torch.manual_seed(0)
    model = sharded_on_meta(shard)
    model.to_empty(device="cpu")
    model.reset_parameters()
    kinds = {(type(p).__name__, p.placements == (Shard(0),), tuple(p.shape)) for p in model.parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, norms = train(model, optimizer, 3, 0, rank)

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    loads_unsharded = None
    if rank == 0:
        plain = Tiny()
        plain.load_state_dict(full)  # strict: every key, full shapes, plain tensors
        loads_unsharded = all(type(v) is torch.Tensor for v in full.values())
    sharded = get_model_state_dict(model)
    sharded_kinds = {(type(v).__name__, v.to_local().shape[0] <= v.shape[0]) for v in sharded.values()}
    full_optim = get_optimizer_state_dict(model, optimizer,
                                          options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    dcp.save({"model": sharded, "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=directory)
    continued = train(model, optimizer, 2, 3, rank)

    torch.manual_seed(1)  # a resumed run does not start from the same numbers
    resumed = sharded_on_meta(shard)
    resumed.to_empty(device="cpu")
    resumed.reset_parameters()
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=0.05)
    state = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, resumed_optimizer)}
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(resumed, state["model"])
    set_optimizer_state_dict(resumed, resumed_optimizer, state["optim"])
    after_resume = train(resumed, resumed_optimizer, 2, 3, rank)

    # A full state dict broadcast from rank 0 into a model still on meta (the example's --dcp-api resume).
    from_full = sharded_on_meta(shard)
    set_model_state_dict(from_full, dict(full) if rank == 0 else {},  # it fills the dict it is given
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    again = get_model_state_dict(from_full, options=StateDictOptions(full_state_dict=True))
    return {"kinds": kinds, "losses": losses, "norms": norms, "full": full if rank == 0 else None,
            "loads_unsharded": loads_unsharded, "sharded_kinds": sharded_kinds,
            "full_optim": full_optim["state"] if rank == 0 else None,
            "continued": continued, "after_resume": after_resume,
            "broadcast_full": {k: v.clone() for k, v in again.items()}}


def test_fsdp2_recipe_gives_what_torchs_fully_shard_gives(ranks, tmp_path):
    pool = ranks(2)
    results = {flavour: pool.run(_recipe, flavour, str(tmp_path / flavour), timeout_s=120)
               for flavour in SHARDERS}
    for rank in range(2):
        ours, theirs = results["minddp"][rank], results["torch"][rank]
        assert ours["kinds"] == theirs["kinds"]
        assert all(kind == "DTensor" and placed for kind, placed, _ in ours["kinds"])
        assert ours["sharded_kinds"] == {("DTensor", True)}
        torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=1e-6, atol=0)
        torch.testing.assert_close(ours["norms"], theirs["norms"], rtol=1e-6, atol=0)
        # torch's clip_grad_norm_ returns the global norm: the same on both ranks
        assert ours["norms"] == results["minddp"][0]["norms"]
        assert ours["continued"] == ours["after_resume"], "a resume from dcp.load continues bit-equal"
        torch.testing.assert_close(ours["broadcast_full"], results["minddp"][0]["full"], rtol=0, atol=0)
    ours, theirs = results["minddp"][0], results["torch"][0]
    assert ours["loads_unsharded"]
    assert {k: tuple(v.shape) for k, v in ours["full"].items()} == {k: tuple(p.shape) for k, p in
                                                                    Tiny().state_dict().items()}
    torch.testing.assert_close(ours["full"], theirs["full"], rtol=1e-6, atol=0)
    torch.testing.assert_close(ours["full_optim"], theirs["full_optim"], rtol=1e-6, atol=0)


def _explicit_prefetch(rank, world_size):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = sharded_on_meta(minddp_fully_shard)
    model.to_empty(device="cpu")
    model.reset_parameters()
    first, second = model.blocks
    first.set_modules_to_forward_prefetch([second])
    second.set_modules_to_backward_prefetch([first])
    launched = []
    original = type(second._fsdp_unit).start_gather
    names = {id(first._fsdp_unit): "first", id(second._fsdp_unit): "second", id(model._fsdp_unit): "root"}

    def watched(unit):
        launched.append((names[id(unit)], unit.state.value))
        original(unit)

    type(second._fsdp_unit).start_gather = watched
    try:
        model.set_prefetch(False)  # only the explicit prefetches: none from the recorded order
        model.unshard()
        model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    finally:
        type(second._fsdp_unit).start_gather = original
    return launched, "first", "second"


def test_explicit_prefetch_starts_the_named_units_gather(ranks):
    for launched, first, second in ranks(2).run(_explicit_prefetch, timeout_s=60):
        # first's forward starts second's gather while second is still sharded (a prefetch, not a late gather)
        at_first = launched.index((first, "sharded"))
        assert (second, "sharded") in launched[at_first + 1:]
        # second's backward starts first's gather again before first's own backward
        assert launched.count((first, "sharded")) == 2
