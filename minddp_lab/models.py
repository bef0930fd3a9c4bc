"""Small models for MNIST-shaped data, each chosen for what it shows about DDP.

=========  ============  ==========================================================
name       parameters    why it is here
=========  ============  ==========================================================
``mlp``    ~5.3 M        communication-bound: many parameters, little compute each,
                         so gradient all-reduce dominates a step (bucketing, overlap
                         and compression show up clearly)
``cnn``    ~30 k         compute-bound: convolutions do ~70 multiply-adds per
                         parameter per image; has BatchNorm2d (SyncBatchNorm demos)
``ae``     ~0.44 M       an autoencoder (reconstruction loss, no labels needed)
``resnet`` ~0.3 M        residual blocks with BatchNorm, the shape of real vision models
=========  ============  ==========================================================

Every model takes images ``[N, 1, 28, 28]``. Classifiers return logits
``[N, 10]``; the autoencoder returns images of the input's shape in ``[0, 1]``.
:func:`model_loss` picks the matching loss, so training code can stay generic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["MODEL_NAMES", "build_model", "model_loss", "GPT", "GPTConfig"]

IMAGE_SHAPE = (1, 28, 28)
PIXELS = 28 * 28
CLASSES = 10


def _mlp() -> nn.Module:
    # Five Linear layers of very different sizes (8 MiB down to 20 KiB of
    # gradient), so bucket boundaries fall in interesting places.
    widths = [PIXELS, 2048, 1024, 1024, 512]
    layers: list[nn.Module] = [nn.Flatten()]
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    layers.append(nn.Linear(widths[-1], CLASSES))
    return nn.Sequential(*layers)


def _conv_bn_relu(c_in: int, c_out: int, stride: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),  # BatchNorm has the bias
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    ]


def _cnn() -> nn.Module:
    return nn.Sequential(
        *_conv_bn_relu(1, 16), nn.MaxPool2d(2),  # 28 -> 14
        *_conv_bn_relu(16, 32), nn.MaxPool2d(2),  # 14 -> 7
        *_conv_bn_relu(32, 64), nn.MaxPool2d(2),  # 7 -> 3
        nn.Flatten(),
        nn.Linear(64 * 3 * 3, CLASSES),
    )


class _Autoencoder(nn.Module):
    def __init__(self, code: int = 32):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Flatten(), nn.Linear(PIXELS, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, code)
        )
        self.decoder = nn.Sequential(
            nn.Linear(code, 64), nn.ReLU(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, PIXELS), nn.Sigmoid()
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(images)).view_as(images)


class _ResidualBlock(nn.Module):
    """conv-BN-ReLU-conv-BN, plus the input (projected when the shape changes), then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            *_conv_bn_relu(c_in, c_out, stride),
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def _resnet() -> nn.Module:
    return nn.Sequential(
        *_conv_bn_relu(1, 16, stride=2),  # 28 -> 14: full resolution would cost 2x the time
        _ResidualBlock(16, 32, stride=1),  # 14 x 14
        _ResidualBlock(32, 64, stride=2),  # 7 x 7
        _ResidualBlock(64, 128, stride=2),  # 4 x 4
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, CLASSES),
    )


_BUILDERS: dict[str, Callable[[], nn.Module]] = {"mlp": _mlp, "cnn": _cnn, "ae": _Autoencoder, "resnet": _resnet}
MODEL_NAMES = tuple(_BUILDERS)


def build_model(name: str) -> nn.Module:
    """A fresh model by name (initialized from torch's global RNG: seed it first)."""
    try:
        return _BUILDERS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}") from None


def model_loss(name: str, output: torch.Tensor, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The training loss of model ``name``: reconstruction error for ``ae``, cross-entropy otherwise."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    if name == "ae":
        return F.mse_loss(output, images)
    return F.cross_entropy(output, labels)


# --------------------------------------------------------------- a small GPT
@dataclass(frozen=True)
class GPTConfig:
    """A GPT-2-shaped language model, small enough for a laptop.

    The defaults give 8 blocks and 100 parameter tensors (~0.9 M parameters):
    many small tensors (LayerNorm weights, biases), which is where a
    wrapper's per-parameter cost shows.
    """

    vocab_size: int = 512
    block_size: int = 64
    n_layer: int = 8
    n_head: int = 4
    n_embd: int = 96
    checkpoint: str | None = None  # None, "reentrant" or "non-reentrant": recompute every block in backward


class _Block(nn.Module):
    """Pre-norm transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.attn_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.mlp_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(attended.transpose(1, 2).reshape(batch, time, channels))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Token embedding, position embedding, pre-norm blocks, final LayerNorm, and a
    head that shares its weight with the token embedding (weight tying, as GPT-2).

    ``forward(tokens[N, T])`` returns logits ``[N, T, vocab]``;
    ``forward(tokens, targets)`` returns the mean cross-entropy instead.
    """

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        if cfg.checkpoint not in (None, "reentrant", "non-reentrant"):
            raise ValueError(f"checkpoint must be None, 'reentrant' or 'non-reentrant', got {cfg.checkpoint!r}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied: one parameter, two uses, one gradient

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            if self.cfg.checkpoint is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.cfg.checkpoint == "reentrant")
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
