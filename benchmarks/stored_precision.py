"""Models stored in float16: how far the audit's float32 computation is from the model's own run.

For each architecture of tests/support/architectures.py, a seeded model is exported to ONNX in float16
(torch's legacy exporter) and saved as float16 TorchScript, then opened by splitaudit. It prints
the gradient mode, and the largest difference between the float32 computation the audit
differentiates and the model run as saved (onnxruntime on the float16 graph, or the float16
TorchScript module), relative to the largest |embedding| and in units of float16's eps: the
measurement behind ROUNDING_EPS (audit/inputs/precision.py), the tolerance of that check.

    python -m benchmarks.stored_precision
    python -m benchmarks.stored_precision --architectures resnet vit --samples 32
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import torch

from splitaudit.inputs.models import open_model, prepare_encoder
from splitaudit.inputs.precision import ROUNDING_EPS
from tests.support.architectures import build, export_onnx, export_torchscript

SHAPES = {
    "resnet": (3, 32, 32),
    "mobilenet": (3, 32, 32),
    "vit": (3, 32, 32),
    "textline": (3, 48, 192),
    "audio1d": (1, 1024),
}
EPS16 = torch.finfo(torch.float16).eps


def measure(name: str, fmt: str, samples: int, folder: Path) -> str:
    """One row: gradient mode and the float32-vs-as-saved difference in float16 eps."""
    shape = SHAPES[name]
    model = build(name).half()
    x = torch.rand(samples, *shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if fmt == "onnx":
            path = export_onnx(model, x[:2].half(), folder / f"{name}16.onnx", exporter="legacy", opset=17)
        else:
            path = export_torchscript(model, x[:2].half(), folder / f"{name}16.pt")
        encoder = prepare_encoder(open_model(path, torch.device("cpu")), x)
        z = encoder.embed(x)
    err = encoder.parity_max_abs_err
    relative = err / float(z.abs().max()) if err is not None else float("nan")
    return f"{name:10} {fmt:11} {encoder.gradient_mode:17} {relative:10.2e} {relative / EPS16:8.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architectures", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    print(
        f"float32 computation against the float16 model as saved ({args.samples} samples; tolerance {ROUNDING_EPS} eps)"
    )
    print(f"{'model':10} {'format':11} {'gradients':17} {'rel. diff':>10} {'eps16':>8}")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.architectures:
            for fmt in ("onnx", "torchscript"):
                try:
                    print(measure(name, fmt, args.samples, Path(folder)))
                except Exception as exc:  # an export or load failure is a row, not the end of the table
                    print(f"{name:10} {fmt:11} failed: {type(exc).__name__}: {str(exc)[:120]}")


if __name__ == "__main__":
    main()
