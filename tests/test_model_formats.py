"""Conformance suite of the model-format registry (splitaudit.core.registries.MODEL_FORMATS): every
format's loader is a ModelLoader found by its registry line, recognises a file of its own format
and no other format's, opens it with report.json's `model.format` set to its name, and ships it to a
worker as files that open the same; and a toy format added by a registry line alone is audited end
to end and rebuilt by a worker (tests/test_docs.py: and listed in the generated reference)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import sample
from test_cli import run_cli

from splitaudit.core import registries
from splitaudit.core.config import AuditOptions
from splitaudit.core.errors import InputError
from splitaudit.core.registries import MODEL_FORMATS, ModelFormat
from splitaudit.engine.pipeline import prepare_context
from splitaudit.execution.recipe import make_recipe, model_files, rebuild_context
from splitaudit.inputs.model_format import ModelLoader, ModelRequest, loader_for
from splitaudit.inputs.models import wrap_module

CPU = torch.device("cpu")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(x))


@pytest.fixture(scope="module")
def format_files(tmp_path_factory) -> dict[str, Path]:
    """One model of every registered format (a tiny linear bottom, or the bundled GPT-2 checkpoint)."""
    folder = tmp_path_factory.mktemp("formats")
    module, x = Tiny().eval(), torch.rand(2, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.trace(module, x).save(str(folder / "tiny.pt"))
        batch = torch.export.Dim("batch", min=1, max=1024)
        torch.export.save(torch.export.export(module, (x,), dynamic_shapes=({0: batch},)), str(folder / "tiny.pt2"))
        torch.onnx.export(
            module, (x,), str(folder / "tiny.onnx"), dynamo=False, dynamic_axes={"x": {0: "n"}}, input_names=["x"]
        )
    return {
        "onnx": folder / "tiny.onnx",
        "torchscript": folder / "tiny.pt",
        "exported": folder / "tiny.pt2",
        "huggingface": Path(sample("text_gpt2")),
    }


def test_every_format_has_a_file_here_and_exactly_one_fallback(format_files):
    assert set(format_files) == set(MODEL_FORMATS), "add a file of the new format to format_files"
    assert sum(fmt.fallback for fmt in MODEL_FORMATS.values()) == 1


@pytest.mark.parametrize("name", list(MODEL_FORMATS))
def test_a_format_recognises_its_own_files_and_no_others(format_files, name):
    loader = loader_for(format_files[name])
    assert isinstance(loader, ModelLoader) and loader.format is MODEL_FORMATS[name]
    own = registries.resolve(MODEL_FORMATS[name].loader)()
    for other, path in format_files.items():
        if other != name:
            assert not own.detect(path) or list(MODEL_FORMATS).index(other) < list(MODEL_FORMATS).index(name), (
                f"{name} claims a {other} file before the {other} loader sees it"
            )


@pytest.mark.parametrize("name", [n for n in MODEL_FORMATS if n != "huggingface"])
def test_a_format_opens_its_file_and_a_workers_copy_the_same(format_files, name, tmp_path):
    """Opened twice, from the file and from the files a worker receives, the model gives the same
    embeddings as the module it was saved from."""
    path = format_files[name]
    x = torch.rand(5, 6)
    expected = Tiny().eval()
    for source in (path, _shipped(path, tmp_path)):
        raw = loader_for(source).open(source, CPU, ModelRequest())
        assert raw.format == name
        with torch.no_grad():
            got = raw.session.run(None, {"x": x.numpy()})[0] if raw.torch_module is None else raw.torch_module(x)
        np.testing.assert_allclose(np.asarray(got), expected(x).detach().numpy(), atol=1e-5)


def test_the_checkpoint_format_opens_its_folder_and_ships_only_its_files(format_files, tmp_path):
    pytest.importorskip("transformers")
    folder = format_files["huggingface"]
    raw = loader_for(folder).open(folder, CPU, ModelRequest(split_layer=1))
    assert raw.format == "huggingface" and raw.tokens is not None
    shipped = model_files(str(folder))
    assert all(name.startswith(f"{folder.name}/") for name in shipped) and f"{folder.name}/config.json" in shipped


def test_a_format_that_cannot_do_something_says_so_in_one_line(format_files, tmp_path):
    """TorchScript keeps no graph to cut; a torch.export program is not cut after a token lookup;
    --split-layer is a checkpoint's option."""
    with pytest.raises(InputError, match="keeps none to cut"):
        loader_for(format_files["torchscript"]).whole_graph(format_files["torchscript"], tmp_path)
    with pytest.raises(InputError, match="torch.export program .* is not cut yet"):
        loader_for(format_files["exported"]).open(format_files["exported"], CPU, ModelRequest(vocab="v.json"))
    with pytest.raises(InputError, match="--split-layer cuts a Hugging Face checkpoint"):
        loader_for(format_files["onnx"]).open(format_files["onnx"], CPU, ModelRequest(split_layer=1))


def test_a_whole_graph_written_from_another_form_comes_with_its_check(format_files, tmp_path):
    """`splitaudit cuts` cuts an ONNX graph: an ONNX file is its own graph (nothing to check); a
    torch.export program is written as one, and its loader's check refuses a graph whose output
    differs from the program's on the data (one line), and passes the graph onnxruntime runs."""
    import onnxruntime as ort

    onnx_graph = loader_for(format_files["onnx"]).whole_graph(format_files["onnx"], tmp_path)
    assert onnx_graph.path == format_files["onnx"] and onnx_graph.check is None
    graph = loader_for(format_files["exported"]).whole_graph(format_files["exported"], tmp_path)
    x = np.random.default_rng(0).random((4, 6), dtype=np.float32)
    session = ort.InferenceSession(str(graph.path), providers=["CPUExecutionProvider"])
    output = session.run(None, {session.get_inputs()[0].name: x})[0].astype(np.float64)
    graph.check(x, output)
    with pytest.raises(InputError, match="differs from the program by 0.1"):
        graph.check(x, output + 0.1)


def _shipped(path: Path, folder: Path) -> Path:
    """The model as a worker writes it from model_files."""
    files = model_files(str(path))
    target = folder / f"shipped-{path.stem}"
    target.mkdir()
    for name, data in files.items():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(data)
    return target / path.name


# A toy format: a .lin file is a linear layer's weight and bias as JSON, opened as a torch module.
class LinearFile(ModelLoader):
    def detect(self, path: Path) -> bool:
        return path.suffix == ".lin"

    def open_file(self, path: Path, device: torch.device, request: ModelRequest):
        saved = json.loads(path.read_text())
        weight, bias = torch.tensor(saved["weight"]), torch.tensor(saved["bias"])
        layer = nn.Linear(weight.shape[1], weight.shape[0])
        layer.load_state_dict({"weight": weight, "bias": bias})
        raw = wrap_module(layer, device, request.mode)
        raw.format, raw.path, raw.declared_input_shape = "linear-file", path, (weight.shape[1],)
        return raw


TOY = ModelFormat("linear-file", "a linear layer saved as JSON", "the suffix .lin", (__name__, "LinearFile"))


@pytest.fixture
def toy_format(monkeypatch):
    monkeypatch.setitem(MODEL_FORMATS, TOY.name, TOY)


def test_a_toy_format_is_audited_and_rebuilt_by_a_worker_by_its_registry_line_alone(toy_format, tmp_path, capsys):
    """`splitaudit run` on a .lin file, and the context a worker rebuilds from the files shipped to it
    (in this process: a spawned worker imports the registry as the source has it, without the toy)."""
    rng = np.random.default_rng(0)
    layer = {"weight": rng.normal(size=(4, 6)).tolist(), "bias": [0.0] * 4}
    (tmp_path / "bottom.lin").write_text(json.dumps(layer))
    x = rng.random((80, 6)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=(x[:, 0] > 0.5).astype(int))
    args = ["run", str(tmp_path / "bottom.lin"), "--aux", str(tmp_path / "data.npz"), "--attacks", "kmeans"]
    code, _, err = run_cli(
        [*args, "--quick", "--workers", "1", "--out", str(tmp_path / "out"), "--format", "json"], capsys
    )
    assert code in (0, 1), err
    result = json.loads((tmp_path / "out" / "report.json").read_text())
    assert result["model"]["format"] == "linear-file" and result["attacks"]["kmeans"]["status"] == "ok"
    options = AuditOptions(model=str(tmp_path / "bottom.lin"), aux=str(tmp_path / "data.npz"), quick=True).validate()
    parent = prepare_context(options)
    worker = rebuild_context(make_recipe(options, parent), "cpu")
    assert worker.encoder.format == "linear-file"
    assert torch.equal(worker.clean_embeddings("target"), parent.clean_embeddings("target"))
