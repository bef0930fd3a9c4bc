"""PLACEHOLDER"""

from __future__ import annotations

import torch
import torchvision

TRACE_BATCH = 4  # the shape of a step, not its length: the published step time sets that
MODELS = ("resnet50", "resnet101", "resnext50_32x4d", "resnext101_32x8d")


def _torchvision(name: str):
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    images = torch.randn(TRACE_BATCH, 3, 224, 224)
    labels = torch.randint(0, 1000, (TRACE_BATCH,))
    return model, images, lambda out: torch.nn.functional.cross_entropy(out, labels)


def resnet50():
    return _torchvision("resnet50")


def resnet101():
    return _torchvision("resnet101")


def resnext50_32x4d():
    return _torchvision("resnext50_32x4d")


def resnext101_32x8d():
    return _torchvision("resnext101_32x8d")
