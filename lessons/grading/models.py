"""The family of models exercises 04-07 are graded on, beyond the bench's plain stack of layers.

Each member holds one of the cases a data-parallel wrapper meets in real
models and a plain stack never shows:

* a frozen parameter (``requires_grad`` False: its ``.grad`` stays ``None``, and no hook may be put on it);
* a trainable parameter that gets no gradient in some steps (a layer used on even steps only: on odd ones
  its ``.grad`` is ``None`` after ``zero_grad``, and must stay so);
* a parameter shared by two layers (tied weights: one tensor, one gradient, summed over both uses);
* a half-precision copy, where the exercise allows it (the gradients must keep their dtype).

``Mixed`` holds the first three at once (``sometimes=False`` leaves out the layer used on even steps only,
for the bucketed exercise, whose buckets wait for every gradient); the bench sets ``Mixed.use_extra`` at
every step's start, for every copy of the model alike.
"""

from __future__ import annotations

import torch
from torch import nn

from lessons._common import CLASSES, FEATURES


class Mixed(nn.Module):
    """A frozen bias (``a.bias``), a weight shared by two layers (``b.weight`` is ``c.weight``) and, with
    ``sometimes``, a layer (``extra``) used on even steps only."""

    use_extra = True  # set by the bench before each step (a class attribute: every copy sees it)

    def __init__(self, sometimes: bool = True, width: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(FEATURES, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)
        self.c.weight = self.b.weight  # tied: one parameter, two uses
        self.head = nn.Linear(width, CLASSES)
        self.extra = nn.Linear(CLASSES, CLASSES) if sometimes else None
        self.a.bias.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))
        out = self.head(h)
        if self.extra is not None and Mixed.use_extra:
            out = out + self.extra(out)
        return out

    @staticmethod
    def step_starts(step: int) -> None:
        Mixed.use_extra = step % 2 == 0

    CASES = ("a frozen parameter (a.bias), a weight shared by two layers (b.weight is c.weight) and a layer used "
             "on even steps only (extra: on odd steps its .grad is None)")
    CASES_WITHOUT_EXTRA = "a frozen parameter (a.bias) and a weight shared by two layers (b.weight is c.weight)"
