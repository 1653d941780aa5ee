"""U-shaped split models on the 1x8x8 digits, for the U-shaped SDAR tests and benchmarks/sdar_curve.py.

Each model is three parts, H = h . g . f (Zhu et al., NDSS 2025, Sec. II): the client's head f
(the audited bottom model), the server's body g and the client's tail h, trained together on
the private (target) data. A U-shaped attacker holds g, never h. Architectures:
- ``flat_ln``: conv 16 + GELU + avg-pool + conv 8 + GELU + flatten + linear 24 + LayerNorm
  without affine (the digits CNN of the U-shaped label tests); g a GELU layer of 32, h a linear classifier;
- ``resnet``: conv + BN + ReLU + a residual basic block (8x8x8 embeddings); g a strided basic
  block, h global average pooling + linear (ResNet-20's U-shaped split, Sec. V-A);
- ``mobilenet``: conv + Hardswish + an inverted residual with squeeze-excitation; g another
  strided inverted residual, h pooling + linear;
- ``vit``: patch embedding (2x2 patches), class token, position embedding and one pre-norm
  attention block (17 tokens of 16); g another block, h LayerNorm + linear on the class token.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.support.architectures import BasicBlock, InvertedResidual, ViTBlock, ViTStem

CLASSES = 10


class FlatLayerNormCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(16, 8, 3, padding=1)
        self.linear = nn.Linear(128, 24)
        self.norm = nn.LayerNorm(24, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.conv2(F.avg_pool2d(F.gelu(self.conv1(x)), 2)))
        return self.norm(self.linear(h.flatten(1)))


class ClassToken(nn.Module):
    """h of the ViT: LayerNorm and a linear classifier on the class token."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(dim), nn.Linear(dim, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(tokens[:, 0]))


def pooled_classifier(channels: int) -> nn.Module:
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, CLASSES))


def parts(name: str) -> tuple[nn.Module, nn.Module, nn.Module]:
    """Freshly initialised (f, g, h) of one architecture."""
    if name == "flat_ln":
        return FlatLayerNormCNN(), nn.Sequential(nn.Linear(24, 32), nn.GELU()), nn.Linear(32, CLASSES)
    if name == "resnet":
        f = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), BasicBlock(8, 8))
        return f, BasicBlock(8, 16, stride=2), pooled_classifier(16)
    if name == "mobilenet":
        f = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.Hardswish(), InvertedResidual(8, 16, 8, 1))
        return f, InvertedResidual(8, 32, 16, 2), pooled_classifier(16)
    if name == "vit":
        f = ViTStem(image_size=8, patch=2, dim=16, depth=1, heads=2, in_channels=1)
        return f, ViTBlock(16, 2), ClassToken(16)
    raise ValueError(f"unknown U-shaped architecture {name!r}")


ARCHITECTURES = ("flat_ln", "resnet", "mobilenet", "vit")


def train_u_shaped(name: str, x: torch.Tensor, y: torch.Tensor, epochs: int = 40, seed: int = 0):
    """(f, g, h, training accuracy): the three parts trained together on (x, y) with Adam, batch
    64, as the client and server train a U-shaped model; returned in eval mode."""
    torch.manual_seed(seed)
    f, g, h = parts(name)
    model = nn.Sequential(f, g, h)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).split(64):
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        accuracy = float((model(x).argmax(1) == y).float().mean())
    return f, g, h, accuracy
