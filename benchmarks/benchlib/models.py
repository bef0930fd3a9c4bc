"""The benchmark's models: how to build each, which batches it eats, which loss it takes.

``minddp_lab.models`` has the image models (``mlp``, ``cnn``, ``ae``, ``resnet``)
and the small ``GPT``; the benchmark adds two names of its own:

* ``gpt``: ``GPT(GPTConfig())``, 8 pre-norm blocks, 100 parameter tensors
  (~0.95 M parameters, the head tied to the token embedding), fed random
  token sequences. Many small tensors (LayerNorm weights, biases) are where a
  wrapper's per-parameter cost shows;
* ``shuffled_mlp``: :class:`overlap.ShuffledMLP`, for ``--learned-order``.

Data are fixed random tensors, different per rank: this measures steps, not learning.
"""

from __future__ import annotations

import torch

from minddp_lab.models import GPT, MODEL_NAMES, GPTConfig, build_model, model_loss

from benchlib import overlap

GPT_NAME = "gpt"
ALL_MODELS = (*MODEL_NAMES, GPT_NAME, overlap.SHUFFLED)
DEFAULT_MODELS = ["mlp", "cnn", "ae", GPT_NAME]

# Per-rank batch size: the MLP is meant to be communication-bound (many
# parameters, little compute per step), the CNN compute-heavier, the
# autoencoder with the 128-image batches of a typical MNIST autoencoder
# tutorial; gpt: 4 sequences of 64 tokens, a step
# of about the CNN's length on one core.
BATCH_SIZE = {"mlp": 32, "cnn": 32, "ae": 128, "resnet": 32, overlap.SHUFFLED: 32, GPT_NAME: 4}
N_BATCHES = 4  # fixed random batches per rank, cycled


def build(name: str) -> torch.nn.Module:
    """A fresh model (initialized from torch's global RNG: seed it first)."""
    if name == GPT_NAME:
        return GPT(GPTConfig())
    if name == overlap.SHUFFLED:
        return overlap.ShuffledMLP()
    return build_model(name)


def batches(name: str, rank: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``N_BATCHES`` (input, target) pairs for ``name``, seeded by ``rank``."""
    g = torch.Generator().manual_seed(1000 + rank)  # different data per rank
    bs = BATCH_SIZE.get(name, 32)
    out = []
    for _ in range(N_BATCHES):
        if name == GPT_NAME:
            cfg = GPTConfig()
            x = torch.randint(0, cfg.vocab_size, (bs, cfg.block_size), generator=g)
            y = torch.randint(0, cfg.vocab_size, (bs, cfg.block_size), generator=g)
        else:
            x, y = torch.rand(bs, 1, 28, 28, generator=g), torch.randint(0, 10, (bs,), generator=g)
        out.append((x.to(device), y.to(device)))
    return out


def loss(name: str, module: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward through ``module`` (bare or wrapped) and the training loss of model ``name``."""
    if name == GPT_NAME:
        return module(inputs, targets)  # GPT computes its own cross-entropy
    # shuffled_mlp is a classifier like mlp: cross-entropy
    return model_loss("mlp" if name == overlap.SHUFFLED else name, module(inputs), inputs, targets)
