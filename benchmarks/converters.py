"""Which ONNX-to-torch converter loads which graph: the evidence behind splitaudit.inputs.onnx_loading.CONVERTERS.

For every graph of the load matrix (the tests' exports: torch dynamo and legacy, the bundled
sample models, and the exporter-style graphs of tests/support/exporter_graphs.py at opsets 9..20) and
for each converter, on the graph as written ("raw") and after splitaudit's clean-up
(splitaudit.inputs.onnx_graph: dynamic dims, onnxslim), it prints whether the converter gave a module
and its max abs error against onnxruntime on random inputs (a module counts only when the error
is within splitaudit's parity tolerance). The last column is what `open_model` +
`prepare_encoder` end with: the converter used, or black-box.

    python -m benchmarks.converters            # about 4 minutes on 2 busy CPU cores
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

from splitaudit.inputs.model_checks import PARITY_RTOL
from splitaudit.inputs.models import open_model, prepare_encoder
from splitaudit.inputs.onnx_graph import declare_dynamic_dims, slimmed
from splitaudit.inputs.onnx_loading import CONVERTERS, import_torchvision_or_stub
from tests.support.architectures import build, export_onnx
from tests.support.exporter_graphs import STYLES, OpsNet, SequenceNet, Style, image_net, write_style

ROOT = Path(__file__).resolve().parents[1]

OPSETS = range(9, 21)
CPU = torch.device("cpu")


def matrix_graphs(folder: Path) -> list[tuple[str, Path, tuple[int, ...]]]:
    """(name, path, per-sample input shape) for every graph of the load matrix."""
    graphs = [
        ("sample digits_cnn.onnx", ROOT / "sample_models" / "digits_cnn.onnx", (1, 8, 8)),
        ("sample digits_mlp.onnx", ROOT / "sample_models" / "digits_mlp.onnx", (1, 8, 8)),
    ]
    for arch in ("resnet", "mobilenet", "vit"):
        for exporter, opset in (("dynamo", 20), ("legacy", 17)):
            model = build(arch, seed=0, width=8) if arch != "vit" else build(arch, seed=0)
            path = export_onnx(
                model, torch.rand(2, 3, 32, 32), folder / f"{arch}_{exporter}.onnx", exporter=exporter, opset=opset
            )
            graphs.append((f"tests {arch} torch {exporter} opset {opset}", path, (3, 32, 32)))
    for style in STYLES:
        graphs.append((style.name, write_style(style, folder)[0], style.shape))
    for opset in OPSETS:
        for name, make, shape in (("ops", OpsNet, (3, 12, 12)), ("mobilenet", image_net, (3, 32, 32))):
            style = Style(f"{name} Constant weights, -1 batch, opset {opset}", make, shape, opset, True, -1)
            graphs.append((style.name, write_style(style, folder)[0], shape))
        seq = Style(f"1-D conv, weights as inputs, opset {opset}", SequenceNet, (4, 400), opset, False, 0, True)
        graphs.append((seq.name, write_style(seq, folder)[0], seq.shape))
    return graphs


def reference_outputs(proto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run([proto.graph.output[0].name], {session.get_inputs()[0].name: x})[0]


def converter_cell(convert, proto, x: np.ndarray, reference: np.ndarray) -> str:
    """'ok 3e-08', 'off 0.2' (converted, parity fails) or 'fail: reason'."""
    try:
        with torch.no_grad():
            out = convert(proto).eval()(torch.from_numpy(x)).numpy()
        err = float(np.abs(out - reference).max())
    except Exception as exc:
        return "fail: " + (str(exc).splitlines() or [type(exc).__name__])[0][:40].replace("|", "/")
    ok = err <= PARITY_RTOL * max(1.0, float(np.abs(reference).max()))
    return f"{'ok' if ok else 'off'} {err:.0e}"


def outcome(path: Path, x: torch.Tensor) -> str:
    """What splitaudit ends with on this graph: the converter it uses, or black-box."""
    try:
        raw = open_model(path, CPU)
        encoder = prepare_encoder(raw, x)
    except Exception as exc:
        return "error: " + str(exc)[:60]
    return raw.converter if encoder.differentiable else "black-box"


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    import_torchvision_or_stub()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        graphs = matrix_graphs(Path(tmp))
        header = ["graph"] + [f"{c} {v}" for v in ("raw", "cleaned") for c in CONVERTERS] + ["splitaudit uses"]
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        totals = np.zeros(2 * len(CONVERTERS) + 1, dtype=int)
        for name, path, shape in graphs:
            x = rng.random((3, *shape), dtype=np.float32)
            raw = onnx.load(str(path))
            declared = onnx.load(str(path))
            declare_dynamic_dims(declared)
            cleaned, _ = slimmed(declared, 1 << 32)
            reference = reference_outputs(declared, x)
            cells = [converter_cell(c, p, x, reference) for p in (raw, cleaned) for c in CONVERTERS.values()]
            used = outcome(path, torch.from_numpy(x))
            totals += [cell.startswith("ok") for cell in cells] + [used in CONVERTERS]
            print("| " + " | ".join([name, *cells, used]) + " |", flush=True)
        print("| **converted with parity, of " + str(len(graphs)) + "** | " + " | ".join(map(str, totals)) + " |")


if __name__ == "__main__":
    main()
