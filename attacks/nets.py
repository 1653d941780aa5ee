"""Small networks the attacks share: re-initialised copies, MLPs, generic encoders, decoders.

Everything is built from shapes alone, so the attacks work for any bottom model.
"""
from __future__ import annotations

import copy
import io
import math
from contextlib import contextmanager

import torch
import torch.nn as nn

from splitaudit.context import AuditContext


@contextmanager
def seeded(seed: int):
    """torch's global RNG seeded for building a network, and restored afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def clone_module(module: nn.Module) -> nn.Module:
    """An independent copy of a module; TorchScript parts are copied by a save/load round trip
    (a deep copy of a ScriptModule no longer passes gradients to its parameters)."""
    scripted: dict[int, nn.Module] = {}
    for name, sub in module.named_modules():
        inside_script = any(name.startswith(prefix + ".") for prefix in scripted.values())
        if isinstance(sub, torch.jit.ScriptModule) and not inside_script:
            scripted[id(sub)] = name
    memo = {key: _script_copy(sub) for key, sub in
            ((id(s), s) for s in module.modules()) if key in scripted}
    return copy.deepcopy(module, memo)


def _script_copy(module: torch.jit.ScriptModule) -> torch.jit.ScriptModule:
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    buffer.seek(0)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return torch.jit.load(buffer, map_location=device)


def reinitialized_copy(module: nn.Module, seed: int) -> nn.Module:
    """A trainable copy of `module` (same architecture) with fresh random weights.

    Works for nn.Module, TorchScript and onnx2pytorch modules alike: weight matrices and
    kernels get PyTorch's default Kaiming-uniform init, biases zero, 1-d scales one.
    """
    fresh = clone_module(module)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            if p.dim() >= 2:
                bound = 1.0 / math.sqrt(p[0].numel())
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
            p.requires_grad_(True)
    return fresh.train()


def mlp(sizes: list[int], activation: type[nn.Module] = nn.GELU) -> nn.Sequential:
    """Linear layers of the given widths with an activation between them (none at the end)."""
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


class Reshape(nn.Module):
    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(len(x), *self.shape)


def generic_encoder(input_shape: tuple[int, ...], output_shape: tuple[int, ...]) -> nn.Module:
    """A network with the bottom model's input and output shapes, for when its architecture is unknown."""
    out = math.prod(output_shape)
    if len(input_shape) == 3:
        channels = input_shape[0]
        body = nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1), nn.GELU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.GELU(),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(64 * 16, out),
        )
    else:
        body = mlp([math.prod(input_shape), 256, 256, out])
    return nn.Sequential(body, Reshape(output_shape))


def bottom_architecture(ctx: AuditContext, seed: int) -> nn.Module:
    """The bottom model's architecture re-initialised when known, else a generic one (same shapes)."""
    known = ctx.encoder.architecture()
    with seeded(seed):
        net = reinitialized_copy(known, seed) if known is not None else \
            generic_encoder(ctx.encoder.input_shape, ctx.encoder.output_shape)
    return net.to(ctx.device).train()


class Decoder(nn.Module):
    """Embedding (and optionally a label) -> input, built from the shapes (SDAR Table IX style).

    Images: a linear layer maps the embedding to a 64-channel map at the image size halved up to
    three times, then a stride-1 transposed-conv block, one Upsample+Conv block per doubling, three more transposed-conv blocks (BN + ReLU each), a final
    conv to the input channels, and a sigmoid when the data lies in [0, 1]. Flat inputs: an MLP.
    """

    def __init__(self, embedding_shape: tuple[int, ...], input_shape: tuple[int, ...],
                 unit_range: bool, num_classes: int | None = None) -> None:
        super().__init__()
        self.input_shape = tuple(input_shape)
        self.label_embedding = nn.Embedding(num_classes, 50) if num_classes else None
        extra = 50 if num_classes else 0
        m = math.prod(embedding_shape)
        self.body = _image_decoder(m + extra, input_shape) if len(input_shape) == 3 \
            else mlp([m + extra, 256, 256, math.prod(input_shape)])
        self.squash = nn.Sigmoid() if unit_range else nn.Identity()

    def forward(self, z: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = z.flatten(1)
        if self.label_embedding is not None:
            h = torch.cat([h, self.label_embedding(y)], dim=1)
        return self.squash(self.body(h)).reshape(len(z), *self.input_shape)


def _conv_block(cin: int, cout: int, transpose: bool = False) -> list[nn.Module]:
    conv = nn.ConvTranspose2d(cin, cout, 3, padding=1) if transpose else nn.Conv2d(cin, cout, 3, padding=1)
    return [conv, nn.BatchNorm2d(cout), nn.ReLU()]


def _image_decoder(m: int, input_shape: tuple[int, int, int]) -> nn.Sequential:
    channels, height, width = input_shape
    doublings = 0
    while doublings < 3 and height % 2 ** (doublings + 1) == 0 and width % 2 ** (doublings + 1) == 0:
        doublings += 1
    h0, w0 = height // 2 ** doublings, width // 2 ** doublings
    start = 64
    layers: list[nn.Module] = [nn.Linear(m, start * h0 * w0), Reshape((start, h0, w0)),
                               nn.BatchNorm2d(start), nn.ReLU()]
    layers += _conv_block(start, 64, transpose=True)
    ch = 64
    for _ in range(doublings):
        layers += [nn.Upsample(scale_factor=2, mode="nearest"), *_conv_block(ch, 32)]
        ch = 32
    for _ in range(3):
        layers += _conv_block(ch, 16, transpose=True)
        ch = 16
    layers.append(nn.Conv2d(ch, channels, 3, padding=1))
    return nn.Sequential(*layers)
