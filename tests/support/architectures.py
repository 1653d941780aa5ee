"""Real architectures at small widths, and the ways users export them, for tests and benchmarks.

torchvision's wheel may not import beside CPU torch here, so the stems are written out:
- ResNet-style: conv 7x7/2, BatchNorm, ReLU, MaxPool 3x3/2, residual basic blocks (ResNet-18's
  stem + layer1 at `width` = 64 and two blocks);
- MobileNet-style: conv stem with Hardswish, inverted residuals with depthwise convolutions
  and squeeze-excitation (MobileNetV3's first stages);
- ViT-style: patch embedding, class token, position embedding, pre-norm attention blocks
  with LayerNorm and GELU;
- text-line MobileNetV3 (PaddleOCR's direction classifier at small widths): its inverted
  residuals halve only the height (stride (2, 1)), so a 3x48x192 line becomes a 16x3x96 map;
- 1-D conv audio/sensor bottom: strided Conv1d + BatchNorm1d + GELU (a wav2vec-style feature
  encoder at small widths), C x T -> width x T/8.

Exports: TorchScript (trace and script), ONNX from the dynamo exporter (external data, as
today's exporters write it) and from the legacy TorchScript-based exporter at a chosen opset,
all with a dynamic batch dimension unless a fixed batch is asked for.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv-BN pairs and a residual add (projection when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetStem(nn.Module):
    """ResNet-18 stem + layer1 (conv 7x7/2, BN, ReLU, MaxPool, `blocks` basic blocks)."""

    def __init__(self, width: int = 8, blocks: int = 2, in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(*[BasicBlock(width, width) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer1(self.pool(F.relu(self.bn1(self.conv1(x)))))


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(channels, reduced, 1)
        self.fc2 = nn.Conv2d(reduced, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(scale))))


class InvertedResidual(nn.Module):
    """MobileNetV3 block: 1x1 expand, depthwise 3x3, squeeze-excitation, 1x1 project, residual."""

    def __init__(self, cin: int, expand: int, cout: int, stride: int | tuple[int, int]) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(cin, expand, 1, bias=False), nn.BatchNorm2d(expand), nn.Hardswish())
        self.depthwise = nn.Sequential(
            nn.Conv2d(expand, expand, 3, stride, 1, groups=expand, bias=False), nn.BatchNorm2d(expand), nn.Hardswish()
        )
        self.se = SqueezeExcite(expand, max(4, expand // 4))
        self.project = nn.Sequential(nn.Conv2d(expand, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride in (1, (1, 1)) and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(self.se(self.depthwise(self.expand(x))))
        return out + x if self.residual else out


class MobileNetStem(nn.Module):
    """MobileNetV3-style stem: conv 3x3/2 + BN + Hardswish, then inverted residual blocks."""

    def __init__(self, width: int = 8, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.Hardswish()
        )
        self.blocks = nn.Sequential(
            InvertedResidual(width, 2 * width, width, 1), InvertedResidual(width, 3 * width, 2 * width, 2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x))


class TextLineMobileNet(nn.Module):
    """MobileNetV3-small-style text-line bottom: conv 3x3/2 + BN + Hardswish, then inverted
    residuals with squeeze-excitation (HardSigmoid) of which three halve only the height, as
    text recognisers' backbones do: 3x48x192 -> out_channels x 3 x 96."""

    def __init__(self, width: int = 8, out_channels: int = 16, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.Hardswish()
        )
        self.blocks = nn.Sequential(
            InvertedResidual(width, 2 * width, width, 1),
            InvertedResidual(width, 3 * width, width, (2, 1)),
            InvertedResidual(width, 3 * width, out_channels, (2, 1)),
            InvertedResidual(out_channels, 3 * out_channels, out_channels, (2, 1)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x))


class AudioConv1d(nn.Module):
    """1-D conv bottom for audio or sensor series: three strided Conv1d + BatchNorm1d + GELU
    stages, C x T -> width x T/8."""

    def __init__(self, width: int = 16, in_channels: int = 1) -> None:
        super().__init__()
        stages, cin = [], in_channels
        for kernel in (9, 5, 5):
            stages += [nn.Conv1d(cin, width, kernel, 2, kernel // 2, bias=False), nn.BatchNorm1d(width), nn.GELU()]
            cin = width
        self.body = nn.Sequential(*stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class RecurrentSeq(nn.Module):
    """Recurrent bottom for C x T sensor series: an LSTM over time (the series transposed to T x C,
    batch first) and a tanh projection of every step's hidden state, C x T -> T x width."""

    def __init__(self, width: int = 8, in_channels: int = 1, hidden: int = 16) -> None:
        super().__init__()
        self.rnn = nn.LSTM(in_channels, hidden, batch_first=True)
        self.project = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps, _ = self.rnn(x.transpose(1, 2))
        return torch.tanh(self.project(steps))


class ViTBlock(nn.Module):
    """Pre-norm transformer block: LayerNorm, multi-head self-attention, LayerNorm, GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViTStem(nn.Module):
    """ViT-style stem: patch embedding (conv, stride = patch), class token, position embedding, blocks."""

    def __init__(
        self, image_size: int = 32, patch: int = 8, dim: int = 16, depth: int = 2, heads: int = 2, in_channels: int = 3
    ) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(in_channels, dim, patch, patch)
        tokens = (image_size // patch) ** 2 + 1
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, tokens, dim))
        self.blocks = nn.Sequential(*[ViTBlock(dim, heads) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return self.blocks(torch.cat([cls, tokens], dim=1) + self.pos_embed)


ARCHITECTURES = {
    "resnet": ResNetStem,
    "mobilenet": MobileNetStem,
    "vit": ViTStem,
    "textline": TextLineMobileNet,
    "audio1d": AudioConv1d,
    "lstm": RecurrentSeq,
}


def build(name: str, seed: int = 0, image_size: int = 32, **kwargs) -> nn.Module:
    """A seeded model in eval mode with non-trivial BatchNorm statistics (as after training)."""
    torch.manual_seed(seed)
    model = ARCHITECTURES[name](image_size=image_size, **kwargs) if name == "vit" else ARCHITECTURES[name](**kwargs)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.1, 0.1)
    return model.eval()


def train_briefly(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int = 3, seed: int = 0) -> nn.Module:
    """`model` trained for a few seeded epochs on its own task (Adam, a linear head on its
    globally pooled output), then its BatchNorm statistics recomputed on `x`; returned in eval mode.

    A bottom with random weights and random BatchNorm statistics is no user's model: on the
    text-line bottom, each block's BatchNorm divides by a running variance near 1 while its
    input varies by ~0.002, and four blocks leave 1e-5 of the output's spread to the input
    (every attack then fails). Training and recomputed statistics give the spread back."""
    torch.manual_seed(seed)
    with torch.no_grad():
        channels = model.train()(x[:2]).shape[1]
    head = nn.Linear(channels, int(y.max()) + 1)
    optimizer = torch.optim.Adam([*model.parameters(), *head.parameters()], lr=3e-3)
    order = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for batch in torch.randperm(len(x), generator=order).split(32):
            optimizer.zero_grad()
            F.cross_entropy(head(model(x[batch]).flatten(2).mean(2)), y[batch]).backward()
            optimizer.step()
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a cumulative average over the recomputing pass
    with torch.no_grad():
        model(x)
    for norm in norms:
        norm.momentum = 0.1
    return model.eval()


def export_torchscript(model: nn.Module, x: torch.Tensor, path: Path, how: str = "trace") -> Path:
    """Save with torch.jit.trace (default) or torch.jit.script."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = torch.jit.script(model) if how == "script" else torch.jit.trace(model, x, check_trace=False)
        module.save(str(path))
    return path


def export_onnx(
    model: nn.Module, x: torch.Tensor, path: Path, exporter: str = "dynamo", opset: int = 18, fixed_batch: bool = False
) -> Path:
    """ONNX with a dynamic batch dimension (unless fixed_batch).

    exporter "dynamo": torch.onnx.export(dynamo=True) with external data (a .data file beside
    the model); "legacy": the TorchScript-based exporter at `opset`, weights inside the file.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            shapes = None if fixed_batch else ({0: torch.export.Dim("batch", min=1, max=4096)},)
            torch.onnx.export(
                model,
                (x,),
                str(path),
                dynamo=True,
                external_data=True,
                dynamic_shapes=shapes,
                opset_version=opset,
                verbose=False,
            )
        else:
            axes = None if fixed_batch else {"x": {0: "batch"}, "z": {0: "batch"}}
            torch.onnx.export(
                model,
                (x,),
                str(path),
                dynamo=False,
                opset_version=opset,
                input_names=["x"],
                output_names=["z"],
                dynamic_axes=axes,
            )
    return path
