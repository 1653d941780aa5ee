"""Hostile places to write: nothing outside --out is created, opened for writing or deleted, and a
run that does not finish leaves no report that reads as its own (issue 39, items 3, 4 and 7).

Every fixture is tiny and made here: the sample breast-cancer MLP with its tensors moved or
relabelled, planted symlinks, a stale passing report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx
import pytest
import torch
from conftest import sample
from onnx.external_data_helper import set_external_data
from test_hostile_inputs import assert_refused, run_cli
from test_hostile_inputs_2 import private_tmp  # noqa: F401 (a fixture)

from splitaudit.core.config import AuditOptions
from splitaudit.core.errors import InputError
from splitaudit.engine.pipeline import prepare_context
from splitaudit.execution.recipe import make_recipe, model_files, rebuild_context

MLP, CANCER = sample("breast_cancer_mlp.onnx"), sample("breast_cancer.npz")
QUICK = ["--attacks", "none", "--quick", "--format", "json"]


# --- 3. a worker's model copy: only what onnx reads, under names splitaudit chooses ------------------


def relabelled_mlp(folder: Path, inline_location: str | None = None, external_location: str | None = None) -> Path:
    """The sample MLP in `folder` as m.onnx: its first weight stored outside the graph in
    weights.bin (a legitimate external tensor), its first bias kept inline but carrying
    `inline_location` (which onnx never reads), and its second weight, when `external_location`
    is given, declared stored there (which onnx reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    proto = onnx.load(MLP)
    tensors = {t.name: t for t in proto.graph.initializer}
    (folder / "weights.bin").write_bytes(tensors["0.weight"].raw_data)
    set_external_data(tensors["0.weight"], "weights.bin")
    tensors["0.weight"].ClearField("raw_data")
    if inline_location is not None:
        entry = tensors["0.bias"].external_data.add()
        entry.key, entry.value = "location", inline_location
    if external_location is not None:
        set_external_data(tensors["2.weight"], external_location)
        tensors["2.weight"].ClearField("raw_data")
    onnx.save(proto, folder / "m.onnx")
    return folder / "m.onnx"


def planted(tmp_path: Path, kind: str) -> str:
    """A location relative to tmp_path/models/deep that a hostile model names: a file two folders
    up, a FIFO, a missing file, or a symlink out of the folder."""
    deep = tmp_path / "models" / "deep"
    deep.mkdir(parents=True, exist_ok=True)
    (tmp_path / "escape.bin").write_bytes(b"attacker's bytes" * 64)
    if kind == "fifo":
        os.mkfifo(deep / "pipe.bin")
        return "pipe.bin"
    if kind == "symlink":
        (deep / "link.bin").symlink_to(tmp_path / "escape.bin")
        return "link.bin"
    return {"escape": "../../escape.bin", "missing": "missing.bin"}[kind]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["escape", "fifo", "missing"])
def test_a_location_on_an_inline_tensor_is_never_opened(tmp_path, kind):
    """The recipe ships the graph and the bytes onnx reads, under the model's own name: an inline
    tensor's location is ignored, as onnx ignores it (before: read, hung on a FIFO, or failed)."""
    model = relabelled_mlp(tmp_path / "models" / "deep", inline_location=planted(tmp_path, kind))
    files = model_files(model)
    assert set(files) == {"m.onnx", "m.onnx.data"}
    assert files["m.onnx.data"] == (model.parent / "weights.bin").read_bytes()
    shipped = onnx.load_from_string(files["m.onnx"])
    assert {t.name: t.raw_data for t in shipped.graph.initializer}["0.bias"] == (
        {t.name: t.raw_data for t in onnx.load(MLP).graph.initializer}["0.bias"]
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["escape", "fifo", "missing", "symlink"])
def test_a_hostile_external_location_is_refused_by_the_recipe(tmp_path, kind):
    """What onnx reads goes through onnx's own reader and its checks (inside the folder, no
    symlink, a regular file): the recipe never reads outside the model's folder or blocks."""
    model = relabelled_mlp(tmp_path / "models" / "deep", external_location=planted(tmp_path, kind))
    with pytest.raises(InputError, match="external data of tensor '2.weight'"):
        model_files(model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["escape", "fifo", "symlink"])
def test_a_run_with_workers_refuses_a_hostile_external_location_promptly(tmp_path, capsys, private_tmp, kind):  # noqa: F811
    model = relabelled_mlp(tmp_path / "models" / "deep", external_location=planted(tmp_path, kind))
    args = ["run", model, "--aux", CANCER, *QUICK, "--workers", "2", "--out", tmp_path / "out"]
    assert_refused(args, capsys, tmp_path, "is not a valid ONNX model")
    assert not (private_tmp / "escape.bin").exists()


@pytest.mark.timeout(180)
def test_workers_rebuild_external_data_and_write_nothing_a_location_names(tmp_path, capsys, private_tmp):  # noqa: F811
    """--workers 2: the workers open the model from their copy (graph and m.onnx.data) and give the
    parent's numbers; the inline tensor's '../../escape.bin', which the old recipe copied to two
    folders above each worker's folder (the temp directory itself), is written nowhere."""
    model = relabelled_mlp(tmp_path / "models" / "deep", inline_location=planted(tmp_path, "escape"))
    code, _, err = run_cli(["run", model, "--aux", CANCER, *QUICK, "--workers", "2", "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["run"]["workers"] == 2 and report["run"]["dfil_shards"]["tasks"] >= 1
    assert not (private_tmp / "escape.bin").exists()
    assert sorted(p.name for p in private_tmp.iterdir() if p.name.startswith("splitaudit")) == []


def test_a_rebuilt_worker_context_embeds_as_the_parent(tmp_path, private_tmp):  # noqa: F811
    model = relabelled_mlp(tmp_path / "models" / "deep", inline_location="../../escape.bin")
    options = AuditOptions(model=str(model), aux=CANCER, quick=True).validate()
    parent = prepare_context(options)
    worker = rebuild_context(make_recipe(options, parent), "cpu")
    assert torch.equal(worker.clean_embeddings("target"), parent.clean_embeddings("target"))
