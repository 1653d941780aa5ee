"""Hostile places to write: nothing outside --out is created, opened for writing or deleted, and a
run that does not finish leaves no report that reads as its own.

Every fixture is tiny and made here: the sample breast-cancer MLP with its tensors moved or
relabelled, planted symlinks, a stale passing report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import sample
from onnx.external_data_helper import set_external_data
from test_hostile_inputs import FIXTURES, assert_refused, fake_audit, run_cli  # noqa: F401 (fake_audit: a fixture)
from test_hostile_inputs_2 import PROGRESS_LINE, private_tmp  # noqa: F401 (private_tmp: a fixture)

from splitaudit.core.config import AuditOptions
from splitaudit.core.errors import InputError
from splitaudit.engine import pipeline
from splitaudit.engine.pipeline import prepare_context
from splitaudit.execution.recipe import make_recipe, model_files, rebuild_context
from splitaudit.reports.writer import load_result

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
@pytest.mark.usefixtures("private_tmp")
def test_a_run_with_workers_refuses_a_hostile_external_location_promptly(tmp_path, capsys, kind):
    model = relabelled_mlp(tmp_path / "models" / "deep", external_location=planted(tmp_path, kind))
    args = ["run", model, "--aux", CANCER, *QUICK, "--workers", "2", "--out", tmp_path / "out"]
    assert_refused(args, capsys, tmp_path, "is not a valid ONNX model")
    assert not (Path(tempfile.gettempdir()) / "escape.bin").exists()


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("private_tmp")
def test_workers_rebuild_external_data_and_write_nothing_a_location_names(tmp_path, capsys):
    """--workers 2: the workers open the model from their copy (graph and m.onnx.data) and run the
    dFIL shards; the inline tensor's '../../escape.bin', which the old recipe copied to two folders
    above each worker's folder (the temp directory itself), is written nowhere."""
    model = relabelled_mlp(tmp_path / "models" / "deep", inline_location=planted(tmp_path, "escape"))
    code, _, err = run_cli(["run", model, "--aux", CANCER, *QUICK, "--workers", "2", "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["run"]["workers"] == 2 and report["run"]["dfil_shards"]["tasks"] >= 1
    temp = Path(tempfile.gettempdir())
    assert not (temp / "escape.bin").exists() and not list(temp.glob("splitaudit-*"))


@pytest.mark.usefixtures("private_tmp")
def test_a_rebuilt_worker_context_embeds_as_the_parent(tmp_path):
    model = relabelled_mlp(tmp_path / "models" / "deep", inline_location="../../escape.bin")
    options = AuditOptions(model=str(model), aux=CANCER, quick=True).validate()
    parent = prepare_context(options)
    worker = rebuild_context(make_recipe(options, parent), "cpu")
    assert torch.equal(worker.clean_embeddings("target"), parent.clean_embeddings("target"))


# --- 4. nothing planted in --out is followed out of it ------------------------------------------------


def outside_file(tmp_path: Path, text: str | None) -> Path:
    """A file outside --out that a planted link points at (absent when text is None)."""
    target = tmp_path / "elsewhere" / "victim"
    target.parent.mkdir(exist_ok=True)
    if text is not None:
        target.write_text(text)
    return target


@pytest.mark.parametrize("exists", [False, True])
@pytest.mark.usefixtures("fake_audit")
def test_a_planted_lock_symlink_is_refused_and_left_alone(tmp_path, capsys, exists):
    """Before: the lock's target was created (or opened) wherever the link pointed, then the link deleted."""
    out, victim = tmp_path / "out", outside_file(tmp_path, "precious" if exists else None)
    out.mkdir()
    (out / ".splitaudit.lock").symlink_to(victim)
    assert_refused(["run", MLP, "--aux", CANCER, "--out", out], capsys, tmp_path, "is a symbolic link")
    assert (out / ".splitaudit.lock").is_symlink()
    assert victim.read_text() == "precious" if exists else not victim.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind, fragment", [("fifo", "not a regular file"), ("hard link", "a hard link")])
@pytest.mark.usefixtures("fake_audit")
def test_a_planted_fifo_or_hard_link_lock_is_refused_promptly(tmp_path, capsys, kind, fragment):
    out, victim = tmp_path / "out", outside_file(tmp_path, "precious")
    out.mkdir()
    os.mkfifo(out / ".splitaudit.lock") if kind == "fifo" else os.link(victim, out / ".splitaudit.lock")
    assert_refused(["run", MLP, "--aux", CANCER, "--out", out], capsys, tmp_path, fragment)
    assert (out / ".splitaudit.lock").exists() and victim.read_text() == "precious"


@pytest.mark.usefixtures("fake_audit")
def test_a_lock_file_splitaudit_did_not_create_is_locked_but_never_removed(tmp_path, capsys):
    """A regular lock file already there (left by a killed run, or put there by someone) is used
    and kept: splitaudit deletes only the lock file it created."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".splitaudit.lock").write_text("")
    code, _, err = run_cli(["run", MLP, "--aux", CANCER, "--out", out], capsys)
    assert code == 0, err
    assert (out / ".splitaudit.lock").is_file()


@pytest.mark.parametrize("name", ["report.json", "report.html", "report.md", "report.sarif", "report_images"])
@pytest.mark.usefixtures("fake_audit")
def test_planted_report_symlinks_are_replaced_not_written_through(tmp_path, capsys, name):
    out, victim = tmp_path / "out", outside_file(tmp_path, "precious")
    out.mkdir()
    (out / name).symlink_to(victim.parent if name == "report_images" else victim)
    code, _, err = run_cli(["run", MLP, "--aux", CANCER, "--out", out, "--format", "json,html,md,sarif"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim"] and victim.read_text() == "precious"
    assert not (out / name).is_symlink() and (out / name).exists()


@pytest.mark.parametrize("name", ["report.html", "report.md"])
def test_render_replaces_a_planted_page_symlink(tmp_path, capsys, name):
    """render writes into the report's folder without clearing it: the page itself is written to
    a temporary file and renamed over the link (before: refused after rendering, as outside --out)."""
    out, victim = tmp_path / "out", outside_file(tmp_path, "precious")
    out.mkdir()
    (out / "report.json").write_bytes((FIXTURES / "image_audit.json").read_bytes())
    (out / name).symlink_to(victim)
    code, _, err = run_cli(["render", out / "report.json"], capsys)
    assert code == 0, err
    assert victim.read_text() == "precious" and (out / name).is_file() and not (out / name).is_symlink()


@pytest.mark.parametrize("target", ["elsewhere", "nowhere/at/all"])
def test_render_refuses_a_planted_figures_folder_link(tmp_path, capsys, target):
    """render (which clears nothing) refuses a figures folder that is a link, dangling or not (before:
    exit 3 from mkdir on a dangling one)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_bytes((FIXTURES / "image_audit.json").read_bytes())
    (tmp_path / "elsewhere").mkdir()
    (out / "report_images").symlink_to(tmp_path / target)
    code, _, err = run_cli(["render", out / "report.json", "--format", "md"], capsys)
    assert code == 2 and err.count("\n") == 1 and "report_images is a symbolic link" in err, err
    assert list((tmp_path / "elsewhere").iterdir()) == [] and (out / "report_images").is_symlink()


# --- 7. a run that does not finish leaves no report of an earlier run --------------------------------


def stale_reports(out: Path, junit: Path) -> None:
    """A complete, passing report of an earlier run (every format) in out, and its JUnit file."""
    out.mkdir(exist_ok=True)
    (out / "report.json").write_bytes((FIXTURES / "image_audit.json").read_bytes())
    assert json.loads((out / "report.json").read_text())["gate"]["passed"] is True
    for name in ("report.html", "report.md", "report.sarif", "report.junit.xml", "sweep.json", "notes.txt"):
        (out / name).write_text("an earlier run's")
    junit.write_text('<testsuite name="splitaudit" tests="1" failures="0"/>')


def test_exit_2_mid_audit_leaves_no_earlier_report(tmp_path, capsys):
    """Data the model cannot take is found after the model loaded (exit 2): the earlier run's
    reports are gone, other files in --out are kept."""
    out, junit = tmp_path / "out", tmp_path / "ci" / "junit.xml"
    junit.parent.mkdir()
    stale_reports(out, junit)
    wide = dict(np.load(CANCER))
    wide["x"] = np.concatenate([wide["x"], wide["x"][:, :1]], axis=1)
    np.savez(tmp_path / "wide.npz", **wide)
    args = ["run", MLP, "--aux", tmp_path / "wide.npz", *QUICK, "--out", out, "--junit", junit]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "the model expects (29,)" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "sweep.json"] and not junit.exists()


def test_a_crash_mid_sweep_leaves_no_earlier_sweep(tmp_path, capsys, monkeypatch):
    from splitaudit.engine import sweep

    def crash(*_args, **_kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(sweep, "run_sweep", crash)
    out, junit = tmp_path / "out", tmp_path / "junit.xml"
    stale_reports(out, junit)
    code, _, err = run_cli(["sweep", MLP, "--aux", CANCER, "--out", out, "--junit", junit], capsys)
    assert code == 3 and "a bug" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", *REPORT_PAGES] and not junit.exists()


REPORT_PAGES = ["report.html", "report.json", "report.junit.xml", "report.md", "report.sarif"]


@pytest.mark.timeout(180)
def test_sigterm_mid_audit_exits_143_and_leaves_no_earlier_report(tmp_path):
    """SIGTERM (a CI job's time-out) once the run holds --out: exit 143, one line, and no
    report.json (before: the earlier run's passing one stayed). The signal lands as the audit
    starts importing its stages, where CPython loses it about 1 time in 3 (see the next test)."""
    out = tmp_path / "out"
    stale_reports(out, tmp_path / "junit.xml")
    args = [sys.executable, "-m", "splitaudit", "run", MLP, "--aux", CANCER, *QUICK, "--workers", "1", "--out", out]
    cli = subprocess.Popen([str(a) for a in args], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / ".splitaudit.lock").exists() and cli.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # until the run holds the folder
    held = time.monotonic()
    while (out / "report.json").exists() and time.monotonic() < held + 2:
        time.sleep(0.02)  # and has cleared it (the old code never did: the signal then came 2 s into the audit)
    cli.send_signal(signal.SIGTERM)
    _, err = cli.communicate(timeout=120)
    assert cli.returncode == 143, err
    *progress, last = [
        line for line in err.splitlines() if line.strip()
    ]  # a pipe is a log: finished stages' lines may come first
    assert "terminated (SIGTERM)" in last and all(PROGRESS_LINE.fullmatch(line) for line in progress), err
    assert not (out / "report.json").exists() and not (out / ".splitaudit.lock").exists()


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_run_whose_signal_was_swallowed_leaves_no_report(tmp_path, capsys, monkeypatch, signum, code):
    """A signal whose exception is lost (CPython drops one raised while compile() runs, as in a lazy
    import; a library may catch it) lets the run go on and write its reports: they are removed and
    the exit is still the signal's (before: a complete report.json stayed beside exit 143)."""
    result = load_result(FIXTURES / "image_audit.json")

    def swallowing(_options, *_args, **_kwargs):
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)
        except BaseException:
            pass
        return dict(result)

    monkeypatch.setattr(pipeline, "run_audit", swallowing)
    out = tmp_path / "out"
    exit_code, _, err = run_cli(["run", MLP, "--aux", CANCER, "--out", out, "--format", "json,html,md,sarif"], capsys)
    assert exit_code == code and len(err.strip().splitlines()) == 1, err
    assert not list(out.glob("report.*"))
