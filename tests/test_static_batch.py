"""Models saved with a static batch (ONNX input [1, 1, 64, W] as exporters write it unless told
otherwise, torch.export programs traced without a dynamic batch): run batched where the batch size
does not enter the computation, in chunks of it (said once) where it does."""

from __future__ import annotations

import dataclasses
import json
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from test_cli import run_cli

from splitaudit.estimators.methods import jacobian_trace
from splitaudit.inputs.models import open_model, prepare_encoder
from tests.support.architectures import export_onnx

CPU = torch.device("cpu")
LINE = (1, 64, 32)  # a captcha text line: one channel, 64 pixels high (the ddddocr OCR model's input height)
RTOL = 1e-5  # batched against one-by-one: the same kernels, summed in another order at most
CHUNKED = "saved with a static batch of 1"


class LineStem(nn.Module):
    """An OCR model's first blocks (conv, BatchNorm, ReLU, max pooling); `flatten` ends with the
    reshape to [batch, -1] that a static export bakes as [1, -1] (legacy) or [1, 2048] (dynamo)."""

    def __init__(self, flatten: bool = False) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.flatten = flatten

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.blocks(x)
        return z.reshape(z.shape[0], -1) if self.flatten else z


def line_stem(flatten: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = LineStem(flatten)
    with torch.no_grad():
        for norm in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
            norm.running_mean.uniform_(-0.1, 0.1)
            norm.running_var.uniform_(0.5, 1.5)
    return model.eval()


def lines(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, *LINE, generator=torch.Generator().manual_seed(seed))


def static_onnx(model: nn.Module, path, exporter: str):
    return export_onnx(
        model, lines(1), path, exporter=exporter, opset=17 if exporter == "legacy" else 18, fixed_batch=True
    )


def static_program(model: nn.Module, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(model, (lines(1),)), str(path))
    return path


def exact_traces(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """||J||_F^2 per sample from the full Jacobian of the original module, one sample at a time."""
    return torch.stack([torch.func.jacrev(model)(xi[None]).pow(2).sum() for xi in x])


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_static_batch_graph_runs_batched_with_the_one_by_one_dfil(tmp_path, exporter):
    model = line_stem()
    path = static_onnx(model, tmp_path / "line.onnx", exporter)
    x = lines(6)
    encoder = prepare_encoder(open_model(path, CPU), x)
    assert encoder.fixed_batch is None and encoder.batch_note is None and encoder.differentiable
    assert not any("batch" in note for note in encoder.warnings)
    with torch.no_grad():
        torch.testing.assert_close(encoder.embed(x), model(x), rtol=1e-4, atol=1e-5)
    one_by_one = dataclasses.replace(encoder, fixed_batch=1)  # the model as it ran before: one sample per call
    batched, chunked = (jacobian_trace(e, x[:3], "reverse") for e in (encoder, one_by_one))
    torch.testing.assert_close(batched.values, chunked.values, rtol=RTOL, atol=0.0)
    torch.testing.assert_close(batched.values, exact_traces(model, x[:3]), rtol=1e-4, atol=0.0)


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_a_batch_baked_into_a_reshape_runs_in_chunks_and_says_so_once(tmp_path, exporter):
    model = line_stem(flatten=True)
    path = static_onnx(model, tmp_path / "flat.onnx", exporter)
    x = lines(5)
    encoder = prepare_encoder(open_model(path, CPU), x)
    assert encoder.fixed_batch == 1
    assert [CHUNKED in note for note in encoder.warnings].count(True) == 1
    assert encoder.batch_note in encoder.warnings
    with torch.no_grad():
        torch.testing.assert_close(encoder.embed(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_static_batch_program_runs_batched_unless_its_batch_is_baked_in(tmp_path):
    x = lines(5)
    for flatten in (False, True):
        model = line_stem(flatten)
        encoder = prepare_encoder(open_model(static_program(model, tmp_path / f"line{flatten}.pt2"), CPU), x)
        assert (encoder.batch_note is not None) == flatten
        assert [CHUNKED in note for note in encoder.warnings].count(True) == int(flatten)
        with torch.no_grad():
            torch.testing.assert_close(encoder.embed(x), model(x), rtol=RTOL, atol=1e-6)
        stem = encoder.torch_fn.inner
        assert (stem.static_batch == 1) == flatten  # ExportedModule: chunks only where the batch is baked in
    batched = prepare_encoder(open_model(tmp_path / "lineFalse.pt2", CPU), x)
    traces = jacobian_trace(batched, x[:2], "reverse").values
    torch.testing.assert_close(traces, exact_traces(line_stem(), x[:2]), rtol=1e-4, atol=0.0)


def test_the_cli_says_once_on_stderr_and_once_in_the_report_that_the_model_runs_in_chunks(tmp_path, capsys):
    path = static_onnx(line_stem(flatten=True), tmp_path / "flat.onnx", "legacy")
    np.savez(tmp_path / "lines.npz", x=lines(40).numpy())
    args = ["run", str(path), "--aux", str(tmp_path / "lines.npz"), "--attacks", "none", "--quick"]
    code, _, err = run_cli([*args, "--prior", "gaussian", "--format", "json", "--out", str(tmp_path / "out")], capsys)
    assert code == 0, err
    assert [line for line in err.splitlines() if CHUNKED in line] == [
        line for line in err.splitlines() if line.startswith("splitaudit: the model was saved")
    ]
    assert sum(CHUNKED in line for line in err.splitlines()) == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert sum(CHUNKED in note for note in report["model"]["warnings"]) == 1
    assert report["dfil"]["method"] == "structured"  # 2048 inputs, 1024 outputs, each from a local patch
    assert any(n.startswith("Jacobian traces by the structured method (exact): ") for n in report["dfil"]["notes"])


@pytest.mark.parametrize("command", [["sweep", "--noise-sigma", "0.5"], ["calibrate", "--target-mse", "0.01"]])
def test_sweep_and_calibrate_say_so_once_on_stderr_too(tmp_path, capsys, command):
    path = static_onnx(line_stem(flatten=True), tmp_path / "flat.onnx", "legacy")
    np.savez(tmp_path / "lines.npz", x=lines(40).numpy())
    args = [command[0], str(path), "--aux", str(tmp_path / "lines.npz"), *command[1:], "--quick", "--prior", "gaussian"]
    out = ["--attacks", "none", "--format", "json", "--out", str(tmp_path / "out")] if command[0] == "sweep" else []
    code, _, err = run_cli([*args, *out], capsys)
    assert code == 0, err
    notices = [line for line in err.splitlines() if CHUNKED in line]
    assert len(notices) == 1 and notices[0].startswith("splitaudit: the model was saved"), err
