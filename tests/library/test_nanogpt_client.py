"""A realistic client: a small GPT trained the way nanoGPT's train.py trains it.

Everything at once: token and position embeddings with the head tied to the
token embedding, pre-norm blocks with LayerNorm, every block recomputed in
backward by a (reentrant) activation checkpoint, AdamW with weight decay on
matrices only, four micro-steps per optimizer step switched with
``model.require_backward_grad_sync``, bf16 autocast, gradient clipping.
MiniDDP must equal torch's DDP after every optimizer step: same seeds, same
shards, every replica starting from a different seed (so the construction
broadcast is tested too).
"""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP
from minddp_lab.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, checkpoint="reentrant")
MICRO_STEPS = 4
OPTIMIZER_STEPS = 3
PER_RANK = 2


def _adamw(model):
    # nanoGPT's groups: decay 2-D tensors (matrices, embeddings), not biases and norms
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))


def _tokens(step, micro, world_size, rank):
    g = torch.Generator().manual_seed(1000 * step + micro)
    data = torch.randint(0, CONFIG.vocab_size, (PER_RANK * world_size, CONFIG.block_size + 1), generator=g)
    mine = data[rank * PER_RANK : (rank + 1) * PER_RANK]
    return mine[:, :-1], mine[:, 1:]


def _train(rank, world_size):
    models, optimizers = {}, {}
    for name, wrapper in (("minddp", MiniDDP), ("torch", TorchDDP)):
        torch.manual_seed(rank)
        models[name] = wrapper(GPT(CONFIG))
        optimizers[name] = _adamw(models[name])
    assert models["minddp"].module.head.weight is models["minddp"].module.wte.weight  # tied
    for step in range(OPTIMIZER_STEPS):
        norms = {}
        for name, model in models.items():
            for micro in range(MICRO_STEPS):
                model.require_backward_grad_sync = micro == MICRO_STEPS - 1  # nanoGPT's idiom
                x, y = _tokens(step, micro, world_size, rank)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x, y) / MICRO_STEPS
                loss.backward()
            norms[name] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
        # AdamW and clipping hide a wrong gradient scale; the norm before clipping does not
        torch.testing.assert_close(norms["minddp"], norms["torch"], rtol=1e-5, atol=0)
        # one synchronized backward (one round of all-reduces) per optimizer step
        assert models["minddp"].reducer.backwards_done == step + 1
        theirs = dict(models["torch"].module.named_parameters())
        for pname, p in models["minddp"].module.named_parameters():
            # Same local gradients, same division before the sum, same order:
            # float32 agreement to a few ulp (AdamW's update is ~lr per step).
            torch.testing.assert_close(p, theirs[pname], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"optimizer step {step}, {pname}: {m}")
    return models["minddp"].module.wte.weight.detach().clone()


@pytest.mark.parametrize("world_size", [2, 3])
def test_nanogpt_style_training_equals_torch_ddp_after_every_step(ranks, world_size):
    weights = ranks(world_size).run(_train, timeout_s=180)
    for w in weights[1:]:
        assert torch.equal(w, weights[0])  # replicas identical
