"""Fully sharded data parallel (ZeRO stage 3) with torch FSDP2's API, on flat units.

One import swaps torch's for ours::

    from minddp.fsdp import fully_shard, MixedPrecisionPolicy, full_state_dict

    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())   # built after: it steps the shards
    loss = model(x, y); loss.backward(); optimizer.step()   # shard .grad: averaged, fp32

What differs from FSDP2: a rank's parameters are plain fp32 tensors, each a
piece of its flattened parameter (1-D, possibly empty), views into one flat
shard per unit, not DTensors; so any torch optimizer steps them at plain
tensor cost (an optimizer whose update depends on a tensor's shape, such as
Adafactor or Muon, would see 1-D pieces). :func:`clip_grad_norm_` replaces
``torch.nn.utils.clip_grad_norm_`` (which would see this rank's pieces only).
Each unit starts from rank 0's values (one scatter per unit, as MiniDDP
starts from rank 0's weights; FSDP2 trusts every rank to have initialized
alike). Buffers and parameters outside every unit are neither sharded nor
synchronized (each rank keeps its own, as with FSDP2). Move the model to its
device before ``fully_shard``.

Read in this order: :mod:`~minddp.fsdp.policy` (dtypes) ->
:mod:`~minddp.fsdp.unit` (one unit's flat shard, gathered and freed, its
gradient reduce-scattered) -> :mod:`~minddp.fsdp.collectives` (how that
reduce-scatter goes on the wire: on Gloo, one exchange at two ranks, an all-reduce in place
at more) -> :mod:`~minddp.fsdp.schedule` (when: forward,
backward, prefetch, the end of backward) -> :mod:`~minddp.fsdp.fully_shard`
(the API: which parameters make a unit, the hooks) -> :mod:`~minddp.fsdp.state_dict`
and :mod:`~minddp.fsdp.checkpoint` -> :mod:`~minddp.fsdp.clip` -> :mod:`~minddp.fsdp.checks`.

An adapter for a course's FSDP tests (``get_fsdp(module, compute_dtype)``,
an after-backward call, a gather of the full parameters) is three short
functions::

    from minddp.fsdp import MixedPrecisionPolicy, fully_shard, full_state_dict, is_sharded

    def get_fsdp(module, compute_dtype=None):
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype)
        for sub in list(module.modules()):      # shard the Linear and Embedding layers
            if isinstance(sub, (nn.Linear, nn.Embedding)):
                fully_shard(sub, mp_policy=policy)
        return module

    def fsdp_on_after_backward(model, optimizer):
        # The shards' gradients are complete when backward returns (it waits for
        # its reduce-scatters). Parameters in no unit (norms) are replicated:
        # average them, as a DDP without a wrapper would.
        for p in model.parameters():
            if p.grad is not None and not is_sharded(p):
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())

    def fsdp_gather_full_params(model):
        return full_state_dict(model)           # {name: full fp32 tensor}, on every rank

(``tests/library/test_fsdp.py``'s ``leaves-only`` case runs exactly these.)
"""

from minddp.fsdp.checkpoint import load_sharded, save_sharded
from minddp.fsdp.clip import clip_grad_norm_
from minddp.fsdp.fully_shard import FSDPModule, UnshardHandle, fully_shard, is_sharded
from minddp.fsdp.policy import MixedPrecisionPolicy
from minddp.fsdp.state_dict import full_state_dict, load_full_state_dict

__all__ = ["FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "clip_grad_norm_", "full_state_dict", "fully_shard", "is_sharded",
           "load_full_state_dict", "load_sharded", "save_sharded"]
