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

from splitaudit.context.audit_context import AuditContext
from splitaudit.core.input_space import InputSpace
from splitaudit.core.registries import MODEL_FORMATS


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
    memo = {key: _script_copy(sub) for key, sub in ((id(s), s) for s in module.modules()) if key in scripted}
    return copy.deepcopy(module, memo)


def _script_copy(module: torch.jit.ScriptModule) -> torch.jit.ScriptModule:
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    buffer.seek(0)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return torch.jit.load(buffer, map_location=device)


def reinitialized_copy(module: nn.Module, seed: int, init: str = "kaiming") -> nn.Module:
    """A trainable copy of `module` (same architecture) with fresh random weights.

    Works for nn.Module, TorchScript and onnx2pytorch modules alike: weight matrices and
    kernels get PyTorch's default Kaiming-uniform init (`init="kaiming"`) or Keras's default
    Glorot-uniform (`init="glorot"`, what the SDAR authors' TensorFlow networks start from),
    biases zero, 1-d scales one.
    """
    fresh = clone_module(module)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            if p.dim() >= 2:
                bound = glorot_bound(p.shape) if init == "glorot" else 1.0 / math.sqrt(p[0].numel())
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
            p.requires_grad_(True)
    return fresh.train()


def glorot_bound(shape: torch.Size) -> float:
    """sqrt(6 / (fan_in + fan_out)) of a dense (out, in) or conv (out, in, *kernel) weight
    (Glorot and Bengio, AISTATS 2010; Keras's glorot_uniform)."""
    receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
    return math.sqrt(6.0 / ((shape[0] + shape[1]) * receptive))


NORMALIZATIONS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


def is_normalization(module: nn.Module) -> bool:
    """torch.nn's normalisation layers, and onnx2pytorch's (LayerNorm, InstanceNorm, BatchNormalization...)."""
    return isinstance(module, NORMALIZATIONS) or type(module).__name__.endswith(("Norm", "Normalization"))


def restore_batch_norm(module: nn.Module) -> bool:
    """Put a BatchNorm2d after every Conv2d of a network that has no normalisation at all.

    ONNX export in inference mode folds BatchNorm into the preceding convolutions, so an
    ONNX-converted ResNet has none left, and a re-initialised copy of it trains without the
    batch norm the original was trained with. Returns whether anything was added (a network
    that already normalises, or has no convolutions, is left as it is; onnx2pytorch's own
    LayerNorm counts: the bundled digits CNN, trained without batch norm, keeps its LayerNorm
    through export and must not get batch norm added).
    """
    if any(is_normalization(m) for m in module.modules()):
        return False
    convs = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Conv2d
    ]
    for parent, name, conv in convs:
        setattr(parent, name, nn.Sequential(conv, nn.BatchNorm2d(conv.out_channels)))
    return bool(convs)


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


def has_spatial_axes(shape: tuple[int, ...]) -> bool:
    """Whether a feature map of this shape (an embedding, a discriminator's input) is channels over
    one or two spatial axes, (C, t) or (C, h, w); flat (m,) maps are not. What the inputs are is
    the input space's to say (`InputSpace.spatial_axes`), never this shape rule's."""
    return len(shape) in (2, 3)


def conv_class(axes: int, transpose: bool = False) -> type[nn.Module]:
    """nn.Conv1d/Conv2d (or their transposes) for samples with `axes` spatial axes."""
    return {(1, False): nn.Conv1d, (2, False): nn.Conv2d, (1, True): nn.ConvTranspose1d, (2, True): nn.ConvTranspose2d}[
        (axes, transpose)
    ]


def batch_norm_class(axes: int) -> type[nn.Module]:
    return {1: nn.BatchNorm1d, 2: nn.BatchNorm2d}[axes]


TABLE_PIXELS = 32 * 32  # Table IX's decoders output 32x32 images


def pixel_scaled_width(base: int, reference_pixels: int, size: tuple[int, ...], low: int, high: int) -> int:
    """Channels of a layer on a map of `size`: `base` at `reference_pixels`, times sqrt(reference
    / pixels), within [low, high]. Width^2 x pixels, the cost of a 3-wide conv, is then the same at
    every stage: a stage that halves both axes doubles the width (Table IX's decoders), one that
    halves a single axis widens by sqrt 2 only, and maps larger than the reference get fewer
    channels instead of costing more per layer."""
    return max(low, min(high, round(base * math.sqrt(reference_pixels / math.prod(size)))))


def generic_encoder(space: InputSpace, output_shape: tuple[int, ...]) -> nn.Module:
    """A network from the input space to the bottom model's output shape, for when its
    architecture is unknown: per-axis strided convolutions when images or sequences map to the
    same spatial axes (a 48x192 line to a 3x96 map halves the height four times and the width
    once), else a conv stem and a dense layer (images to other shapes) or an MLP (tabular rows,
    token embeddings)."""
    input_shape, out = space.sample_shape, math.prod(output_shape)
    if space.spatial_axes and len(output_shape) == len(input_shape):
        body = downsampling_stages(input_shape, output_shape)
    elif space.kind == "image":
        channels = input_shape[0]
        body = nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.GELU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(64 * 16, out),
        )
    else:
        body = mlp([math.prod(input_shape), 256, 256, out])
    return nn.Sequential(body, Reshape(output_shape))


ENCODER_BASE_WIDTH = 32  # the generic encoder's first conv on a 32x32 image, as before it halved per axis
ENCODER_WIDTHS = (8, 256)


def downsampling_stages(input_shape: tuple[int, ...], output_shape: tuple[int, ...]) -> nn.Sequential:
    """3-wide convs from (C, *size) to (C', *size'): a first conv, then one stride-2 conv per
    halving, each halving only the axes still larger than the target (widths by
    `pixel_scaled_width`, 32 channels at 32x32 pixels), an adaptive average pool to the exact
    size and a 1-wide conv to C'."""
    channels, *size = input_shape
    out_channels, *target = output_shape
    axes = len(size)
    conv = conv_class(axes)
    width = pixel_scaled_width(ENCODER_BASE_WIDTH, TABLE_PIXELS, size, *ENCODER_WIDTHS)
    layers: list[nn.Module] = [conv(channels, width, 3, padding=1), nn.GELU()]
    current = list(size)
    while any(s > 2 * t - 1 for s, t in zip(current, target)):
        stride = [2 if s > 2 * t - 1 else 1 for s, t in zip(current, target)]
        current = [-(-s // k) for s, k in zip(current, stride)]
        cout = pixel_scaled_width(ENCODER_BASE_WIDTH, TABLE_PIXELS, current, *ENCODER_WIDTHS)
        layers += [conv(width, cout, 3, stride=stride, padding=1), nn.GELU()]
        width = cout
    if current != list(target):
        layers.append({1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d}[axes](tuple(target)))
    layers.append(conv(width, out_channels, 1))
    return nn.Sequential(*layers)


def bottom_architecture(ctx: AuditContext, seed: int, init: str = "kaiming", batch_norm: bool = False) -> nn.Module:
    """The bottom model's architecture re-initialised when known, else a generic one (same shapes).

    `batch_norm`: give the convolutions back the batch norm that export folded into them, for a
    format whose exporters fold it (ONNX; `restore_batch_norm`).
    """
    known = ctx.encoder.architecture()
    with seeded(seed):
        if known is None:
            net = generic_encoder(ctx.space, ctx.encoder.output_shape)
        else:
            net = reinitialized_copy(known, seed, init)
            fmt = MODEL_FORMATS.get(ctx.encoder.format)
            if batch_norm and fmt is not None and fmt.folds_batch_norm:
                restore_batch_norm(net)
    return net.to(ctx.device).train()


class Decoder(nn.Module):
    """Embedding (and optionally a label) -> input, built from the embedding's shape and the input
    space (SDAR Table IX style).

    Spatial embeddings of images or sequences with the same axes, (C, h, w) of images or (C, t) of
    sequences, stay spatial (Zhu et al., NDSS 2025, App. B-C, Table IX): the label, when given,
    becomes one more input channel (50-unit embedding -> dense layer -> reshape), and upsampling
    stages follow, each growing the positions 4x as Table IX's do and each axis only by what it
    still needs (`stage_sizes`, `upsampling_stages`), e.g. 64x8x8 -> 3x32x32 exactly as Table IX's
    level-7 decoder. Every layer is convolutional, so memory grows with the input's pixels, never
    with a dense layer at full resolution.
    Flat embeddings of image inputs: a linear stem to a 64-channel map at the image size halved
    up to three times (more for large images, down to at most 7x7), then a stride-1
    transposed-conv block, one Upsample+Conv block per doubling and three transposed-conv blocks.
    Other pairs (tabular inputs, flat embeddings of sequences, and token embeddings T x D, whose
    axes are positions and features, not channels over a signal): an MLP. BN + ReLU after every
    conv; a sigmoid when the input space lies in [0, 1].
    """

    def __init__(self, embedding_shape: tuple[int, ...], space: InputSpace, num_classes: int | None = None) -> None:
        super().__init__()
        self.input_shape = input_shape = space.sample_shape
        self.spatial = bool(space.spatial_axes) and len(embedding_shape) == len(input_shape)
        if self.spatial:
            channels, *size = embedding_shape
            self.label = LabelChannel(num_classes, tuple(size)) if num_classes else None
            self.body = nn.Sequential(
                *upsampling_stages(channels + (1 if num_classes else 0), tuple(size), input_shape)
            )
        else:
            self.label_embedding = nn.Embedding(num_classes, LABEL_EMBEDDING) if num_classes else None
            m = math.prod(embedding_shape) + (LABEL_EMBEDDING if num_classes else 0)
            self.body = (
                _image_decoder(m, input_shape) if space.kind == "image" else mlp([m, 256, 256, math.prod(input_shape)])
            )
        self.squash = nn.Sigmoid() if space.unit_range else nn.Identity()

    def forward(self, z: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if self.spatial:
            h = z if self.label is None else torch.cat([z, self.label(y)], dim=1)
        else:
            h = z.flatten(1)
            if self.label_embedding is not None:
                h = torch.cat([h, self.label_embedding(y)], dim=1)
        return self.squash(self.body(h)).reshape(len(z), *self.input_shape)


class LabelChannel(nn.Module):
    """A class label as one extra channel over the spatial axes: 50-unit embedding -> dense ->
    reshape (Table IX)."""

    def __init__(self, num_classes: int, size: tuple[int, ...]) -> None:
        super().__init__()
        self.size = tuple(size)
        self.net = nn.Sequential(
            nn.Embedding(num_classes, LABEL_EMBEDDING), nn.Linear(LABEL_EMBEDDING, math.prod(self.size))
        )

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.net(y).reshape(len(y), 1, *self.size)


LABEL_EMBEDDING = 50  # Table IX: labels -> Embedding(num_classes, 50) -> Dense
DECODER_BASE_WIDTH = 16  # Table IX: the last stage's transposed convs have 16 filters
DECODER_WIDTHS = (4, 256)


STAGE_GROWTH = 4  # Table IX's upsampling stages double both axes: 4x the positions


def stage_sizes(size: tuple[int, ...], target: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The map's size after each upsampling stage. Each stage grows the positions by Table IX's
    factor 4, shared among the axes still below their target (two short axes double, a single one
    quadruples), and no axis is taken past its target, so the last stage lands on it exactly:
    8x8 -> 32x32 as Table IX (16x16, 32x32); 3x96 -> 48x192: 6x192, 24x192, 48x192, three stages
    where doubling one axis per stage took four (6x192, 12x192, 24x192, 48x192) at the same
    cost each (`upsampling_stages`' widths). Empty when no axis needs to grow."""
    sizes, current = [], tuple(size)
    while any(s < t for s, t in zip(current, target)):
        short = sum(s < t for s, t in zip(current, target))
        factor = round(STAGE_GROWTH ** (1 / short))
        current = tuple(min(t, factor * s) if s < t else t for s, t in zip(current, target))
        sizes.append(current)
    return sizes


def upsampling_stages(cin: int, size: tuple[int, ...], input_shape: tuple[int, ...]) -> list[nn.Module]:
    """Conv layers from a (cin, *size) map to an input-shaped image or sequence (Table IX's decoders).

    One stage per `stage_sizes` step: the last stage is Upsample -> Conv 2w -> 3 x ConvT w;
    each earlier one Upsample -> Conv 2w -> 2 x ConvT w, w from `pixel_scaled_width`: 16 at the
    output (Table IX) for outputs of up to 32x32 pixels, doubling per stage when both axes
    double (capped at 256), so 8x8 -> 32x32 (ResNet-20 split level 7) is Up, Conv 64, ConvT 32
    x2, Up, Conv 32, ConvT 16 x3, Conv 3; larger outputs get the width Table IX gives a 32x32 map
    of the same pixel count (a 48x192 line: 5 at full size), so that no stage costs more than
    Table IX's last and the decoder's cost follows its stage count (3 for a 3x96 -> 48x192 line).
    Axes the map already covers are resized to the input's (nearest) first.
    """
    channels, *target = input_shape
    target = tuple(target)
    axes = len(target)
    reference = min(TABLE_PIXELS, math.prod(target))  # where the width is 16
    width = lambda at: pixel_scaled_width(DECODER_BASE_WIDTH, reference, at, *DECODER_WIDTHS)
    sizes = stage_sizes(size, target)
    layers: list[nn.Module] = []
    if not sizes:
        if tuple(size) != target:
            layers.append(nn.Upsample(size=target, mode="nearest"))
        layers += _conv_block(cin, 2 * width(target), axes)
        cin = 2 * width(target)
    for stage, stage_size in enumerate(sizes):
        last = stage == len(sizes) - 1
        width_out = width(stage_size)
        wide = min(2 * width_out, DECODER_WIDTHS[1])
        layers += [nn.Upsample(size=stage_size, mode="nearest"), *_conv_block(cin, wide, axes)]
        cin = wide
        for _ in range(3 if last else 2):
            layers += _conv_block(cin, width_out, axes, transpose=True)
            cin = width_out
    if not sizes:
        for _ in range(3):
            layers += _conv_block(cin, width(target), axes, transpose=True)
            cin = width(target)
    layers.append(conv_class(axes)(cin, channels, 3, padding=1))
    return layers


def _conv_block(cin: int, cout: int, axes: int = 2, transpose: bool = False) -> list[nn.Module]:
    return [conv_class(axes, transpose)(cin, cout, 3, padding=1), batch_norm_class(axes)(cout), nn.ReLU()]


def _image_decoder(m: int, input_shape: tuple[int, int, int]) -> nn.Sequential:
    """Flat embedding -> image: linear stem to a small map, then upsampling (see Decoder)."""
    channels, height, width = input_shape
    doublings = 0
    while (
        height % 2 ** (doublings + 1) == 0
        and width % 2 ** (doublings + 1) == 0
        and (doublings < 3 or min(height, width) // 2**doublings > 7)
    ):
        doublings += 1
    h0, w0 = height // 2**doublings, width // 2**doublings
    start = 64
    layers: list[nn.Module] = [
        nn.Linear(m, start * h0 * w0),
        Reshape((start, h0, w0)),
        nn.BatchNorm2d(start),
        nn.ReLU(),
    ]
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


def decode_batch(input_shape: tuple[int, ...], budget_values: int = 2**25, cap: int = 512) -> int:
    """Samples per inference batch so that a full-resolution 16-channel map stays near
    `budget_values` numbers (128 MiB): 512 for 8x8 digits and 32x32 images, 41 at 3x224x224."""
    positions = math.prod(input_shape[1:] if has_spatial_axes(input_shape) else input_shape)
    return max(1, min(cap, budget_values // (DECODER_BASE_WIDTH * positions)))
