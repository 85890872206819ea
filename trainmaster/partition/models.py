"""Small real models to partition from the CLI (``module:callable``) and in the pipeline demo.

torchvision does not import here, so these are built by hand: an MLP and an Inception-style
CNN with parallel branches (the shape where placement across devices matters).
"""

from __future__ import annotations

import torch
from torch import nn


def mlp(width: int = 256, depth: int = 6, inputs: int = 64, classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class InceptionBlock(nn.Module):
    """Four parallel branches concatenated, as in Inception-V3."""

    def __init__(self, cin: int, c: int):
        super().__init__()
        self.b1 = nn.Conv2d(cin, c, 1)
        self.b3 = nn.Sequential(nn.Conv2d(cin, c, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.b5 = nn.Sequential(nn.Conv2d(cin, c, 1), nn.ReLU(), nn.Conv2d(c, c, 5, padding=2))
        self.pool = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(cin, c, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.cat([self.b1(x), self.b3(x), self.b5(x), self.pool(x)], dim=1))


def inception(blocks: int = 3, width: int = 16, classes: int = 10) -> nn.Module:
    """Input (N, 3, H, W)."""
    mods: list[nn.Module] = [nn.Conv2d(3, 4 * width, 3, padding=1), nn.ReLU()]
    for _ in range(blocks):
        mods.append(InceptionBlock(4 * width, width))
    mods += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, classes)]
    return nn.Sequential(*mods)


def encoder(width: int = 64, heads: int = 4, layers: int = 2) -> nn.Module:
    """A bare nn.TransformerEncoder (batch first), input (N, S, width): the module whose fused
    inference fast path a module-level trace hides inside one opaque node."""
    layer = nn.TransformerEncoderLayer(width, heads, 2 * width, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
