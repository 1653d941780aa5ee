"""torch.export programs (.pt2): loaded with autograd, checked against the module they were exported
from (an independent computation of f and of its vector-Jacobian products), and audited end to end
with the numbers of the TorchScript of the same weights."""

from __future__ import annotations

import io
import json
import pathlib
import sys
import warnings
import zipfile

import pytest
import torch
import torch.nn as nn
from conftest import SAMPLES, sample
from test_cli import run_cli

from splitaudit.attacks.parts.nets import reinitialized_copy
from splitaudit.core.errors import InputError
from splitaudit.inputs.models import open_model, prepare_encoder, prepare_top_model
from tests.support.architectures import build

CPU = torch.device("cpu")
RTOL = 1e-5  # the program's aten kernels against the module's: the same kernels, reordered at most


def export(module: nn.Module, x: torch.Tensor, path, dynamic: bool):
    shapes = ({0: torch.export.Dim("batch", min=1, max=4096)},) if dynamic else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(module, (x,), dynamic_shapes=shapes), str(path))
    return path


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("dynamic", [False, True], ids=["static batch 1", "dynamic batch"])
def test_exported_resnet_stem_loads_with_autograd_and_matches_its_module(tmp_path, dynamic):
    """BatchNorm, MaxPool and residuals; torch.export's default fixes the example's batch (1), which
    the loader frees (the stem's outputs do not depend on it), so any batch works in one call, for the
    encoder and for attacks' trained copies."""
    module = build("resnet", width=4)
    path = export(module, torch.rand(1 if not dynamic else 2, 3, 16, 16), tmp_path / "stem.pt2", dynamic)
    x = torch.rand(5, 3, 16, 16)
    encoder = prepare_encoder(open_model(path, CPU), x)
    assert encoder.gradient_mode == "autograd" and encoder.format == "exported"
    assert encoder.batch_note is None and encoder.torch_fn.inner.static_batch is None
    assert any("non-smooth operators" in note and "relu" in note for note in encoder.warnings)
    with torch.no_grad():
        expected = module(x)
    for _ in range(2):
        assert relative(encoder.embed(x), expected) < RTOL
    cotangent = torch.randn_like(expected[:3])
    vjps = [torch.func.vjp(fn, x[:3])[1](cotangent)[0] for fn in (encoder, module)]
    assert relative(*vjps) < RTOL
    copy = reinitialized_copy(encoder.architecture(), seed=0)  # what fine-tune and SDAR train
    assert copy(x).shape == expected.shape and copy.training


def test_exported_dict_outputs_are_selected_by_key(tmp_path):
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x: torch.Tensor):
            z = torch.tanh(self.conv(x))
            return {"hidden": z, "pooled": z.mean((2, 3))}

    torch.manual_seed(0)
    module = TwoHeads().eval()
    path = export(module, torch.rand(2, 3, 8, 8), tmp_path / "heads.pt2", dynamic=True)
    x = torch.rand(4, 3, 8, 8)
    first = prepare_encoder(open_model(path, CPU), x)
    assert any("dict of outputs (hidden, pooled)" in note for note in first.warnings)
    pooled = prepare_encoder(open_model(path, CPU, output_name="pooled"), x)
    with torch.no_grad():
        assert relative(first.embed(x), module(x)["hidden"]) < RTOL
        assert relative(pooled.embed(x), module(x)["pooled"]) < RTOL
    with pytest.raises(InputError, match=r"'logits' is not an output of the model \(outputs: hidden, pooled\)"):
        open_model(path, CPU, output_name="logits")


def test_truncated_program_and_model_modes_are_refused_in_one_line(tmp_path, capsys):
    path = export(build("resnet", width=4), torch.rand(1, 3, 16, 16), tmp_path / "stem.pt2", dynamic=False)
    with pytest.raises(InputError, match="runs in the mode it was exported in"):
        open_model(path, CPU, mode="train")
    truncated = tmp_path / "truncated.pt2"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    code, _, err = run_cli(["run", str(truncated), "--aux", sample("digits.npz"), "--quick"], capsys)
    assert code == 2 and "truncated.pt2" in err and "Traceback" not in err


def test_digits_audit_from_a_program_gives_the_torchscript_numbers(tmp_path, capsys):
    """The bundled digits CNN's weights exported by torch.export (static batch 1) and as TorchScript:
    the same function, so the same Jacobian traces and attack results (tolerances: float reordering)."""
    sys.path.insert(0, str(SAMPLES))
    from build import DigitsCNN

    module = DigitsCNN()
    module.load_state_dict(torch.jit.load(sample("digits_cnn.pt")).state_dict())
    program = export(module.eval(), torch.rand(1, 1, 8, 8), tmp_path / "digits.pt2", dynamic=False)
    reports = {}
    for name, model in (("program", program), ("torchscript", sample("digits_cnn.pt"))):
        args = ["run", str(model), "--aux", sample("digits.npz"), "--attacks", "kmeans", "--quick", "--format", "json"]
        code, _, _ = run_cli([*args, "--out", str(tmp_path / name)], capsys)
        assert code == 0
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())
    program_dfil, script_dfil = (reports[k]["dfil"]["trace_over_d"] for k in ("program", "torchscript"))
    assert abs(program_dfil - script_dfil) <= 1e-6 * script_dfil
    metrics = {k: reports[k]["attacks"]["kmeans"]["metrics"] for k in reports}
    assert metrics["program"] == metrics["torchscript"]


class Touches:
    """Unpickling this object creates a file: what a crafted archive's pickle could do instead."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_archive_whose_loading_would_unpickle_objects_is_refused_before_loading(tmp_path):
    """torch.export.load reads sample inputs with torch.load and retries with weights_only=False when
    the safe load fails; splitaudit checks every such member first and never lets that run."""
    path = export(build("resnet", width=4), torch.rand(1, 3, 16, 16), tmp_path / "stem.pt2", dynamic=False)
    crafted, marker = tmp_path / "crafted.pt2", tmp_path / "code-ran"
    payload = io.BytesIO()
    torch.save(Touches(marker), payload)
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(crafted, "w") as target:
        for item in source.infolist():
            data = payload.getvalue() if "sample_inputs" in item.filename else source.read(item)
            target.writestr(item, data)
    with pytest.raises(InputError, match="never does"):
        open_model(crafted, CPU)
    assert not marker.exists()


def test_exported_top_model_is_opened_as_the_audit_opens_it(tmp_path):
    """The audit opens --top-model in eval mode, which an exported program (like an ONNX graph) already is."""
    torch.manual_seed(0)
    top = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).eval()
    path = export(top, torch.rand(2, 4, 4, 4), tmp_path / "top.pt2", dynamic=True)
    embeddings = torch.rand(6, 4, 4, 4)
    module, forward, _ = prepare_top_model(open_model(path, CPU, mode="eval"), embeddings)
    with torch.no_grad():
        assert relative(forward(embeddings), top(embeddings)) < RTOL
    assert module is not None
