"""A real client: torchvision's resnet18, trained the way torchvision's reference script trains it.

torchvision's ``references/classification/train.py`` runs, each epoch, a
training pass (SGD with momentum and weight decay, label smoothing, a
learning-rate schedule) and then an evaluation *through the DDP wrapper*:
``model.eval()`` and forwards under ``torch.inference_mode()``. Here each
optimizer step also accumulates two micro-batches with ``no_sync()``, as
large-batch recipes do.

MiniDDP and torch's DDP train side by side in the same process, from the same
weights, on the same batches; after every optimizer step their parameters and
buffers (BatchNorm's running statistics: 20 layers of them) must agree, and
so must their evaluation outputs, on every rank. Why this is not vacuous:
each rank's images are its own, so the ranks' BatchNorm statistics differ
until a broadcast makes them agree, and a missed broadcast before evaluation
(the bug this test was written for) makes the ranks' evaluation logits differ.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP

EPOCHS, STEPS_PER_EPOCH, MICRO_BATCHES, PER_RANK = 2, 2, 2, 4


def _images(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def _trainer(wrapper, state):
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(state)
    model = wrapper(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler


def _train_step(model, optimizer, rank, step):
    model.train()
    optimizer.zero_grad()
    for micro in range(MICRO_BATCHES):
        x, y = _images(1000 * step + 10 * micro + rank, PER_RANK)
        last = micro == MICRO_BATCHES - 1
        with (model.no_sync() if not last else torch.enable_grad()):
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1) / MICRO_BATCHES
            loss.backward()
    optimizer.step()


def _evaluate(model, rank):
    model.eval()
    with torch.inference_mode():
        return model(_images(99_999 + rank, PER_RANK)[0])


def _largest_difference(a, b):
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b))


def _train_side_by_side(rank, world_size):
    torch.manual_seed(0)
    state = torchvision.models.resnet18(num_classes=10).state_dict()
    ours, our_opt, our_sched = _trainer(MiniDDP, state)
    torchs, torch_opt, torch_sched = _trainer(TorchDDP, state)
    params_gap = buffers_gap = logits_gap = 0.0
    evaluations = []
    for epoch in range(EPOCHS):
        for s in range(STEPS_PER_EPOCH):
            step = epoch * STEPS_PER_EPOCH + s
            _train_step(ours, our_opt, rank, step)
            _train_step(torchs, torch_opt, rank, step)
            params_gap = max(params_gap, _largest_difference(ours.parameters(), torchs.parameters()))
            buffers_gap = max(buffers_gap, _largest_difference(
                [b.float() for b in ours.module.buffers()], [b.float() for b in torchs.module.buffers()]))
        our_sched.step()
        torch_sched.step()
        our_logits, torch_logits = _evaluate(ours, rank), _evaluate(torchs, rank)
        logits_gap = max(logits_gap, (our_logits - torch_logits).abs().max().item())
        # What every rank reports must be the same model: compare the ranks'
        # logits on one shared input.
        shared = _images(7, PER_RANK)[0]
        ours.eval()
        with torch.inference_mode():
            evaluations.append(ours.module(shared))
    gathered = [torch.zeros_like(evaluations[-1]) for _ in range(world_size)]
    dist.all_gather(gathered, evaluations[-1].clone())
    ranks_gap = max((g - gathered[0]).abs().max().item() for g in gathered)
    return params_gap, buffers_gap, logits_gap, ranks_gap


def test_resnet18_as_torchvisions_reference_script_trains_it(ranks):
    for rank, (params_gap, buffers_gap, logits_gap, ranks_gap) in enumerate(ranks(2).run(_train_side_by_side,
                                                                                         timeout_s=120)):
        # On 2 ranks an all-reduce adds two numbers, which float32 does the same
        # way in any bucket layout, so the two wrappers can agree to the bit;
        # 1e-6 leaves room only for a different order of the same float ops.
        assert params_gap <= 1e-6, f"rank {rank}: parameters differ from torch's DDP by {params_gap}"
        assert buffers_gap <= 1e-6, f"rank {rank}: buffers differ from torch's DDP by {buffers_gap}"
        assert logits_gap <= 1e-5, f"rank {rank}: evaluation logits differ from torch's DDP by {logits_gap}"
        assert ranks_gap == 0.0, f"rank {rank}: the ranks evaluate different models (logits differ by {ranks_gap})"
