"""Models stored in float16 or float64 load with autograd and are audited on their own weights.

The reference for every check is the torch module the file was saved from, upcast to float32 by
hand (float16) or run in float64 (an independent computation of the function the audit should
differentiate); tolerances are stated where they are used.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import TensorProto, helper

from splitaudit.core.errors import InputError
from splitaudit.inputs.models import open_model, prepare_encoder
from splitaudit.inputs.precision import float32_graph
from tests.support.architectures import build, export_onnx, export_torchscript

CPU = torch.device("cpu")
FLOAT32_RTOL = 1e-5  # float32 against float32 (or float64), reordered sums
FLOAT16_RTOL = 4e-3  # a float16 run against float32 on the same weights: 4 eps of float16, relative to max |z|
# The float32 copy of a float16 graph against the module on the same rounded weights: the graph's own
# constants (GELU's 1/sqrt(2), say) are stored in float16 too; measured 4e-5, far below float16's 1e-3.
STORED_CONSTANTS_RTOL = 2e-4


class SmallCNN(nn.Module):
    """conv-GELU-conv/2: smooth, so gradients compare exactly, and nothing for an exporter to fold
    (a BatchNorm folded into the conv in float16 rounds other weights than the module's)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 4, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.gelu(self.conv1(x)))


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN().eval()


def rounded_to_half(model: nn.Module) -> nn.Module:
    """The model's weights as a float16 file stores them, in float32."""
    model.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
    return model


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def vjp(fn, x: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
    return torch.func.vjp(fn, x)[1](cotangent)[0]


def export_half_onnx(model: nn.Module, path, x: torch.Tensor):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model.half(), (x.half(),), str(path), dynamo=False, opset_version=17,
            input_names=["x"], dynamic_axes={"x": {0: "batch"}},
        )  # fmt: skip
    return path


def check_audited_function(path, reference: nn.Module, x: torch.Tensor, stored: str, rtol: float) -> None:
    """The encoder loads with autograd, says how the model is stored, and matches the reference (run
    in its own dtype) in float32 embeddings and in VJPs, on two calls."""
    encoder = prepare_encoder(open_model(path, CPU), x)
    assert encoder.gradient_mode == "autograd"
    assert any(f"stored in {stored}" in note for note in encoder.warnings)
    dtype = next(reference.parameters()).dtype
    for _ in range(2):
        z = encoder.embed(x)
        assert z.dtype == torch.float32
        assert relative(z, forward(reference, x.to(dtype)).float()) < rtol
        cotangent = torch.randn_like(z[:3])
        expected = vjp(reference, x[:3].to(dtype), cotangent.to(dtype)).float()
        assert relative(vjp(encoder, x[:3], cotangent), expected) < rtol


def test_float16_onnx_graph_is_audited_in_float32_on_its_weights(tmp_path):
    x = torch.rand(6, 3, 12, 12)
    path = export_half_onnx(small_cnn(), tmp_path / "half.onnx", x)
    check_audited_function(path, rounded_to_half(small_cnn()), x, "float16", STORED_CONSTANTS_RTOL)


def test_float16_graph_with_float32_inputs_and_casts_inside_converts(tmp_path):
    """onnxconverter-common's keep_io_types style: float32 in and out, Cast to float16 inside.
    The graph rewrite turns the Casts to float32 too, or the converted module would mix precisions."""
    x = torch.rand(6, 3, 12, 12)
    path = export_half_onnx(small_cnn(), tmp_path / "half.onnx", x)
    proto = onnx.load(str(path))
    graph = proto.graph
    inner_in, inner_out = graph.input[0].name, graph.output[0].name
    graph.input[0].name, graph.output[0].name = "x32", "z32"
    graph.input[0].type.tensor_type.elem_type = graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT
    graph.node.insert(0, helper.make_node("Cast", ["x32"], [inner_in], to=TensorProto.FLOAT16))
    graph.node.append(helper.make_node("Cast", [inner_out], ["z32"], to=TensorProto.FLOAT))
    onnx.save(proto, str(tmp_path / "keep_io.onnx"))
    check_audited_function(tmp_path / "keep_io.onnx", rounded_to_half(small_cnn()), x, "float16", STORED_CONSTANTS_RTOL)


def test_float32_graph_rewrite_leaves_no_half_precision_type(tmp_path):
    x = torch.rand(2, 3, 12, 12)
    proto = onnx.load(str(export_half_onnx(small_cnn(), tmp_path / "half.onnx", x)))
    float32_graph(proto)
    onnx.checker.check_model(proto)
    types = {init.data_type for init in proto.graph.initializer} | {
        i.type.tensor_type.elem_type for i in proto.graph.input
    }
    assert types == {TensorProto.FLOAT}


def test_float16_vit_graph_loads_without_crashing_onnxruntime(tmp_path):
    """onnxruntime 1.31's NCHWc layout pass kills the process (SIGSEGV) on this float16 ViT stem's
    graph; the loader turns that pass off for half-precision graphs. Loaded in a child process, so
    that a crash fails this test instead of the suite."""
    x = torch.rand(4, 3, 32, 32)
    path = export_half_onnx(build("vit"), tmp_path / "vit16.onnx", x)
    code = (
        "import torch\n"
        "from splitaudit.inputs.models import open_model, prepare_encoder\n"
        f"e = prepare_encoder(open_model({str(path)!r}, torch.device('cpu')), torch.rand(4, 3, 32, 32))\n"
        "print(e.gradient_mode, e.parity_max_abs_err)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    mode, err = run.stdout.split()
    assert mode == "autograd" and float(err) < 16 * torch.finfo(torch.float16).eps


def test_float16_torchscript_is_audited_in_float32(tmp_path):
    x = torch.rand(6, 3, 12, 12)
    path = export_torchscript(small_cnn().half(), x.half(), tmp_path / "half.pt")
    check_audited_function(path, rounded_to_half(small_cnn()), x, "float16", STORED_CONSTANTS_RTOL)
    saved = torch.jit.load(str(path))
    assert relative(prepare_encoder(open_model(path, CPU), x).embed(x), forward(saved, x.half()).float()) < FLOAT16_RTOL


class CastsToHalf(nn.Module):
    """A float16 model that casts its input itself: its float32 copy still computes in float16."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.half())


def test_float16_torchscript_that_casts_inside_is_refused_with_the_reason(tmp_path):
    path = export_torchscript(CastsToHalf().half(), torch.rand(2, 3, 8, 8).half(), tmp_path / "casts.pt")
    with pytest.raises(InputError, match=r"stored in float16.*float32 copy.*fails to run.*model.float\(\)"):
        prepare_encoder(open_model(path, CPU), torch.rand(6, 3, 8, 8))


def tabular_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 6)).eval()


@pytest.mark.parametrize("kind", ["torchscript", "onnx"])
def test_float64_model_runs_in_float64_with_float32_embeddings(tmp_path, kind):
    """A float64 CNN in TorchScript; a float64 MLP in ONNX (onnxruntime has no float64 Conv on CPU)."""
    if kind == "torchscript":
        x, model = torch.rand(6, 3, 12, 12), small_cnn().double()
        path = export_torchscript(model, x.double(), tmp_path / "double.pt")
    else:
        x, model = torch.randn(6, 10), tabular_mlp().double()
        path = export_onnx(model, x.double(), tmp_path / "double.onnx", exporter="legacy", opset=17)
    check_audited_function(path, model, x, "float64", FLOAT32_RTOL)


class SpectrumHalf(nn.Module):
    """A float16 audio bottom with an FFT inside: torch has no half-precision FFT on CPU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(1, 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(torch.fft.rfft(x).abs()))


def test_float16_model_that_cannot_run_as_saved_here_is_audited_and_says_unchecked(tmp_path):
    """Its float32 copy runs; the rounding check cannot, and the report says so instead of agreeing."""
    model = SpectrumHalf().eval()
    path = tmp_path / "spectrum.pt"
    torch.jit.script(model.half()).save(str(path))
    x = torch.rand(6, 1, 64)
    encoder = prepare_encoder(open_model(path, CPU), x)
    assert encoder.gradient_mode == "autograd" and encoder.parity_max_abs_err is None
    assert any("not checked against the model's own float16 run" in note for note in encoder.warnings)
    assert relative(encoder.embed(x), forward(model.float(), x)) < FLOAT32_RTOL
