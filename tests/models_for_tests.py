"""Small models that stress what MiniDDP must get right, and a seeded data stream."""

import torch
from torch import nn

IN_FEATURES = 64  # an 8x8 image for the CNN, a flat vector for the others


class MLP(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN_FEATURES, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4))

    def forward(self, x):
        return self.net(x)


class Awkward(nn.Module):
    """A frozen parameter, one Linear reached through two names and used twice, a float64 head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(IN_FEATURES, 16)
        shared = nn.Linear(16, 16)
        self.first_use = shared
        self.second_use = shared  # same parameters: must be reduced once
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.head64 = nn.Linear(16, 4).double()

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.first_use(h))
        h = self.frozen(h)
        h = torch.tanh(self.second_use(h))
        return self.head64(h.double()).float()


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 8, 3, padding=1), nn.ReLU()
        )
        self.head = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        return self.head(self.features(x.view(-1, 1, 8, 8)).flatten(1))


MODELS = {"mlp": MLP, "awkward": Awkward, "cnn": CNN}


def build(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def global_batch(step: int, size: int):
    """The same global batch on every rank: inputs and targets for one step."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, IN_FEATURES, generator=g), torch.randn(size, 4, generator=g)
