"""Fully sharded data parallel (ZeRO stage 3) with torch FSDP2's API, on flat units.

One import swaps torch's for ours::

    from minddp.fsdp import fully_shard, MixedPrecisionPolicy, full_state_dict

    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())   # built after: it steps the shards
    loss = model(x, y); loss.backward(); optimizer.step()   # shard .grad: averaged, fp32

As FSDP2: a rank's parameters are DTensors sharded on dim 0 (``Shard(0)``)
over the unit's DeviceMesh, of the full logical shape; their local rows are
views into one flat shard per unit, which the all-gather sends as it is. So
``nn.init``, shape-aware optimizers, ``torch.nn.utils.clip_grad_norm_``,
``p.full_tensor()`` and ``torch.distributed.checkpoint``'s state-dict helpers
work on them, and FSDP2's recipe runs::

    with torch.device("meta"):
        model = Transformer(args)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")      # each rank allocates its shard
    model.reset_parameters()          # nn.init on the DTensors

:func:`clip_grad_norm_` is the same global norm in one all-reduce, and also
takes parameters outside every unit. A model built with values (not on
meta) starts each unit from rank 0's values (one scatter per unit, as
MiniDDP starts from rank 0's weights; FSDP2 trusts every rank to have
initialized alike). Buffers and parameters outside every unit are neither
sharded nor synchronized (each rank keeps its own, as with FSDP2). Move or
convert the model before ``fully_shard`` (``.to``/``.half`` after it raise).

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
