"""ONNX graphs in the styles other exporters write (Paddle2ONNX, tf2onnx, old torch), for the load matrix.

A small torch module is exported by torch's legacy exporter at a chosen opset, then rewritten the
way those exporters write graphs: weights as Constant nodes (0 initializers, Paddle2ONNX), the
dynamic batch declared as -1 or 0 instead of a symbol, initializers also listed as graph inputs
(IR < 4). The modules carry the operators those graphs use: NHWC Transposes around convs
(tf2onnx), Clip with min/max as inputs, HardSigmoid/HardSwish, Pad, Resize, and a batch-dynamic
Reshape/Transpose/Slice. Shared by tests/test_exporters.py and benchmarks/converters.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import helper, numpy_helper

from tests.support.architectures import MobileNetStem, build, export_onnx

TEXT_LINE = (3, 48, 192)
SEQUENCE = (4, 400)


class TextLineNet(nn.Module):
    """MobileNetV3-style bottom for 3x48x192 text lines (conv/2, Hardswish, two inverted residual blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MobileNetStem(width=8, in_channels=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class SequenceNet(nn.Module):
    """1-D conv bottom on C x T sequences (audio, sensor series): conv/2, ReLU6 (Clip), conv/2, GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(SEQUENCE[0], 8, 5, stride=2, padding=2)
        self.conv2 = nn.Conv1d(8, 8, 5, stride=2, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.conv2(F.relu6(self.conv1(x))))


class NHWCNet(nn.Module):
    """tf2onnx style: the input is NHWC, Transposed to NCHW around the convs and back."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 4, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(torch.clamp(self.conv1(x.permute(0, 3, 1, 2)), -0.5, 1.5))
        return h.permute(0, 2, 3, 1)


class OpsNet(nn.Module):
    """HardSigmoid, HardSwish, Pad (reflect), Resize (bilinear), and a batch-dynamic Reshape,
    Transpose and Slice: the shapes flow through Shape/Gather/Concat at run time."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.hardswish(self.conv(F.pad(x, (1, 1, 1, 1), mode="reflect")))
        h = F.interpolate(h, scale_factor=2.0, mode="bilinear", align_corners=False) * F.hardsigmoid(h).mean(
            dim=(1, 2, 3), keepdim=True
        )
        h = h.reshape(x.shape[0], 4, -1).transpose(1, 2)
        return h[:, 1:-1, :]


@dataclass(frozen=True)
class Style:
    """One exporter style: the module, the input shape, the opset, and the graph rewrites."""

    name: str
    make: Callable[[], nn.Module]
    shape: tuple[int, ...]
    opset: int
    constant_weights: bool = False
    batch_dim: int | str | None = "batch"  # what the graph declares as the batch: -1, 0, a symbol
    weights_as_inputs: bool = False


def image_net() -> nn.Module:
    return build("mobilenet", seed=0, width=4)


STYLES = [
    Style("paddle text line (Constant weights, -1 batch, opset 11)", TextLineNet, TEXT_LINE, 11, True, -1),
    Style("1-D conv C x T (Constant weights, 0 batch, opset 13)", SequenceNet, SEQUENCE, 13, True, 0),
    Style("tf2onnx NHWC transposes + Clip inputs (opset 13, -1 batch)", NHWCNet, (16, 16, 3), 13, False, -1),
    Style("HardSigmoid/HardSwish, Pad, Resize, dynamic Reshape/Slice (opset 14)", OpsNet, (3, 12, 12), 14),
    Style("initializers listed as inputs (IR 3, opset 9)", SequenceNet, SEQUENCE, 9, False, "N", True),
    Style("mobilenet opset 10 (Constant weights)", image_net, (3, 32, 32), 10, True, "batch"),
    Style("mobilenet opset 17", image_net, (3, 32, 32), 17),
    Style("text line opset 20", TextLineNet, TEXT_LINE, 20, False, -1),
]


def seeded(make: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return make().eval()


def write_style(style: Style, folder: Path, seed: int = 0) -> tuple[Path, nn.Module]:
    """Export the style's module and rewrite the graph as that exporter would; (path, module)."""
    module = seeded(style.make, seed)
    path = folder / (style.name.split(" (")[0].replace(" ", "_").replace("/", "_") + f"_op{style.opset}.onnx")
    export_onnx(module, torch.rand(2, *style.shape), path, exporter="legacy", opset=style.opset)
    proto = onnx.load(str(path))
    if style.constant_weights:
        weights_to_constants(proto)
    if style.weights_as_inputs:
        list_weights_as_inputs(proto)
    if style.batch_dim != "batch":
        declare_batch(proto, style.batch_dim)
    onnx.save(proto, str(path))
    return path, module


def weights_to_constants(proto: onnx.ModelProto) -> None:
    """Paddle2ONNX style: every initializer becomes a Constant node at the top of the graph."""
    constants = [
        helper.make_node("Constant", [], [init.name], value=numpy_helper.from_array(numpy_helper.to_array(init)))
        for init in proto.graph.initializer
    ]
    nodes = constants + list(proto.graph.node)
    del proto.graph.initializer[:]
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)


def list_weights_as_inputs(proto: onnx.ModelProto) -> None:
    """IR < 4 style: every initializer is also a graph input (with its type and shape); graphs of
    opset 9 also declare IR 3, as exporters of that time did."""
    for init in proto.graph.initializer:
        proto.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    if proto.opset_import[0].version <= 9:
        proto.ir_version = 3


def declare_batch(proto: onnx.ModelProto, value: int | str) -> None:
    """Write the first dimension of the data input and of the outputs as `value` (-1, 0 or a symbol)."""
    weights = {init.name for init in proto.graph.initializer}
    for info in [i for i in proto.graph.input if i.name not in weights] + list(proto.graph.output):
        dim = info.type.tensor_type.shape.dim[0]
        if isinstance(value, str):
            dim.dim_param = value
        else:
            dim.Clear()
            dim.dim_value = value
