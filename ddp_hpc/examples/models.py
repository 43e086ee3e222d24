"""Small built-in models for the demo jobs and tests (config `model.name`).

Kept tiny on purpose: the demo must finish in under a minute on 2 CPU processes, and the tests
compare parameters bit for bit, so the models are plain Linear/ReLU stacks (optionally with
dropout, to prove RNG state is restored on resume, and batch norm, to exercise buffer sync).
"""
from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """in_dim -> hidden x depth -> num_classes; `dropout` and `batchnorm` are optional."""

    def __init__(self, in_dim: int = 32, hidden: int = 64, num_classes: int = 10, depth: int = 2,
                 dropout: float = 0.0, batchnorm: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = in_dim
        for _ in range(depth):
            layers.append(nn.Linear(d, hidden))
            if batchnorm:
                layers.append(nn.BatchNorm1d(hidden))
            layers.append(nn.ReLU())
            if dropout:
                layers.append(nn.Dropout(dropout))
            d = hidden
        layers.append(nn.Linear(d, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class Linear(nn.Module):
    """A single linear layer: the smallest model whose DDP result can be checked by hand."""

    def __init__(self, in_dim: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.fc = nn.Linear(in_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


class SmallCNN(nn.Module):
    """Two conv layers for small images (the image-folder job), e.g. 3x32x32 -> num_classes."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


BUILTIN_MODELS = {"mlp": MLP, "linear": Linear, "small_cnn": SmallCNN}
