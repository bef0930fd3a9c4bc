"""The model zoo: shapes, sizes, losses."""

import pytest
import torch
from torch import nn

from minddp_lab.models import MODEL_NAMES, build_model, model_loss

# The size each model is there for (see minddp_lab/models.py).
PARAMS = {"mlp": (4e6, 6e6), "cnn": (1e4, 1e5), "ae": (1e5, 1e6), "resnet": (1e5, 1e6)}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_shapes_sizes_and_loss(name):
    torch.manual_seed(0)
    model = build_model(name)
    low, high = PARAMS[name]
    assert low <= sum(p.numel() for p in model.parameters()) <= high
    images, labels = torch.rand(5, 1, 28, 28), torch.randint(0, 10, (5,))
    output = model(images)
    if name == "ae":
        assert output.shape == images.shape and 0 <= output.min() and output.max() <= 1
    else:
        assert output.shape == (5, 10)
    loss = model_loss(name, output, images, labels)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_models_with_batchnorm():
    for name in ("cnn", "resnet"):
        assert any(isinstance(m, nn.BatchNorm2d) for m in build_model(name).modules())


def test_losses_are_the_right_ones():
    images, labels = torch.rand(3, 1, 28, 28), torch.tensor([1, 2, 3])
    torch.testing.assert_close(model_loss("ae", images * 0.5, images, labels), ((images * 0.5 - images) ** 2).mean())
    logits = torch.randn(3, 10)
    torch.testing.assert_close(model_loss("cnn", logits, images, labels), nn.functional.cross_entropy(logits, labels))


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="unknown model 'vgg'; choose one of mlp, cnn, ae, resnet"):
        build_model("vgg")
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        model_loss("vgg", torch.zeros(1), torch.zeros(1), torch.zeros(1))
