"""Quantized ONNX models (QDQ, as onnxruntime.quantization writes them) are audited straight-through.

Their exact Jacobian is zero almost everywhere, so before they ran black-box and finite differences
measured rounding steps (on a MobileNet stem the van Trees bound came out 5000x below the float
model's). The reference is the float model they were quantized from: the straight-through function
differs from it only by the weights' rounding to int8.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from splitaudit.inputs.models import open_model, prepare_encoder
from tests.support.architectures import export_onnx

CPU = torch.device("cpu")
INT8_RTOL = 0.05  # int8 weights and activations against float32: a few % of the largest value (measured 1-2%)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 4, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.gelu(self.conv1(x)))


def quantized(tmp_path, per_channel: bool, operators: bool = False):
    """SmallCNN quantized by onnxruntime.quantization: QDQ pairs, or integer kernels (QOperator)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    model = SmallCNN().eval()
    source = export_onnx(model, torch.rand(2, 3, 12, 12), tmp_path / "float.onnx", exporter="legacy", opset=17)
    name = onnx.load(str(source)).graph.input[0].name
    batches = iter([{name: np.random.default_rng(i).random((8, 3, 12, 12), dtype=np.float32)} for i in range(4)])

    class Calibration(CalibrationDataReader):
        def get_next(self):
            return next(batches, None)

    path = tmp_path / "qdq.onnx"
    form = QuantFormat.QOperator if operators else QuantFormat.QDQ
    quantize_static(str(source), str(path), Calibration(), quant_format=form, per_channel=per_channel)
    return path, model


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("per_channel", [False, True], ids=["per tensor", "per channel"])
def test_qdq_model_is_differentiated_straight_through(tmp_path, per_channel):
    path, model = quantized(tmp_path, per_channel)
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in onnx.load(str(path)).graph.node}
    x = torch.rand(6, 3, 12, 12)
    encoder = prepare_encoder(open_model(path, CPU), x)
    assert encoder.gradient_mode == "autograd"
    note = next(w for w in encoder.warnings if w.startswith("the model is quantized"))
    assert "straight-through" in note and "differ from the quantized model's by up to" in note
    with torch.no_grad():
        expected = model(x)
    for _ in range(2):
        assert relative(encoder.embed(x), expected) < INT8_RTOL
    cotangent = torch.randn_like(expected[:3])
    vjps = [torch.func.vjp(fn, x[:3])[1](cotangent)[0] for fn in (encoder, model)]
    assert relative(*vjps) < INT8_RTOL  # the Jacobian of the float model, up to the weights' rounding
    assert relative(*vjps) > 0  # with dequantized weights, not the float model's own


def test_integer_kernel_model_runs_black_box_and_says_its_bounds_are_unreliable(tmp_path):
    path, _ = quantized(tmp_path, per_channel=False, operators=True)
    encoder = prepare_encoder(open_model(path, CPU), torch.rand(6, 3, 12, 12))
    assert encoder.gradient_mode == "finite-difference"
    note = next(w for w in encoder.warnings if w.startswith("the model is quantized with integer kernels"))
    assert "QLinearConv" in note and "unreliable" in note


def test_dynamically_quantized_model_runs_one_sample_at_a_time(tmp_path):
    """quantize_dynamic's DynamicQuantizeLinear scales by the whole batch's range, so a sample's
    embedding depends on its batch: refused before, with advice about BatchNorm. Each sample now
    runs alone, as onnxruntime gives it on a batch of one."""
    import onnxruntime as ort
    from onnxruntime.quantization import quantize_dynamic

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    source = export_onnx(mlp, torch.rand(2, 16), tmp_path / "mlp.onnx", exporter="legacy", opset=17)
    quantize_dynamic(str(source), str(tmp_path / "dynamic.onnx"))
    x = torch.rand(10, 16)
    encoder = prepare_encoder(open_model(tmp_path / "dynamic.onnx", CPU), x)
    assert any("one sample at a time" in w for w in encoder.warnings)
    session = ort.InferenceSession(str(tmp_path / "dynamic.onnx"), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    alone = np.concatenate([session.run(None, {name: row[None]})[0] for row in x.numpy()])
    for _ in range(2):
        np.testing.assert_allclose(encoder.embed(x).numpy(), alone, rtol=1e-6, atol=1e-6)
