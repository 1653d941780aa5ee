"""Provenance: every result records the SHA-256 of what it read, and `splitaudit verify` checks files
against it (exit 0 verified, 1 at the first file that differs or a dFIL that does not reproduce, 2 bad
input), on a real quick audit of the bundled digits CNN."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import sample
from onnx import numpy_helper

from splitaudit.cli import main
from splitaudit.core.config import AuditOptions
from splitaudit.core.errors import InputError
from splitaudit.core.result import first_error
from splitaudit.engine.provenance import fingerprint
from splitaudit.engine.verify import inside, recorded_options
from splitaudit.inputs.digests import InputFiles, file_sha256, folder_sha256

MODEL, DATA = sample("digits_cnn.onnx"), sample("digits.npz")
AUDIT = ["--attacks", "none", "--quick", "--prior", "gaussian", "--dfil-samples", "64", "--noise-sigma", "0.5"]


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """A real quick audit (no attack) of the sample CNN at sigma 0.5: its report.json's path."""
    out = tmp_path_factory.mktemp("audit")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", MODEL, "--aux", DATA, *AUDIT, "--format", "json", "--out", str(out)])
    assert exit_info.value.code == 0
    return out / "report.json"


def sha256_of(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def one_weight_changed(tmp_path):
    """A copy of the sample model with one weight of its first initializer changed by 1e-3."""
    proto = onnx.load(MODEL)
    tensor = max(proto.graph.initializer, key=lambda t: np.prod(t.dims))
    weights = numpy_helper.to_array(tensor).copy()
    weights.flat[0] += 1e-3
    tensor.CopyFrom(numpy_helper.from_array(weights, tensor.name))
    onnx.save(proto, tmp_path / "changed.onnx")
    return tmp_path / "changed.onnx"


def test_report_records_the_digests_versions_and_invocation(audited):
    report = json.loads(audited.read_text())
    provenance = report["provenance"]
    files = {f["role"]: f for f in provenance["files"]}
    assert list(files) == ["model", "aux"]
    assert files["model"]["sha256"] == sha256_of(MODEL) and files["aux"]["sha256"] == sha256_of(DATA)
    assert files["model"]["bytes"] == os.path.getsize(MODEL)
    assert provenance["fingerprint"] == fingerprint(provenance["files"], report["tool"]["version"])
    assert len(provenance["fingerprint"]) == 12
    assert provenance["versions"]["torch"] == torch.__version__
    assert provenance["versions"]["onnx"] == onnx.__version__
    assert provenance["converter"] == "onnx2pytorch"
    assert provenance["command_line"][:3] == ["splitaudit", "run", MODEL]
    assert provenance["options"]["noise_sigma"] == 0.5 and provenance["options"]["prior"] == "gaussian"
    assert provenance["seed"] == 0 and provenance["seeds"] == report["run"]["seeds"]
    assert provenance["started"] <= provenance["ended"]
    assert first_error(report) is None


def test_verify_accepts_the_audited_files_wherever_they_lie(audited, tmp_path, capsys):
    shutil.copy(MODEL, tmp_path / "moved.onnx")
    code, out, _ = run_cli(["verify", audited, "--model", tmp_path / "moved.onnx"], capsys)
    assert code == 0
    assert "verified: 2 file(s)" in out and json.loads(audited.read_text())["provenance"]["fingerprint"] in out


def test_verify_refuses_a_model_with_one_weight_changed(audited, tmp_path, capsys):
    code, out, err = run_cli(["verify", audited, "--model", one_weight_changed(tmp_path)], capsys)
    assert code == 1
    assert "NOT the audited files: model" in err and "changed.onnx differs" in err
    assert "verified" not in out


def test_verify_names_the_data_when_it_differs(audited, tmp_path, capsys):
    with np.load(DATA) as npz:
        arrays = dict(npz)
    arrays["x"][0, 0, 0, 0] += 0.5
    np.savez(tmp_path / "data.npz", **arrays)
    code, _, err = run_cli(["verify", audited, "--aux", tmp_path / "data.npz"], capsys)
    assert code == 1 and "NOT the audited files: aux" in err


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda r: r.pop("provenance"), "has no provenance section"),
        (lambda r: r["provenance"].update(fingerprint="000000000000"), "not that of its own digests"),
        (lambda r: r["provenance"]["files"][0].update(sha256="0" * 64), "not that of its own digests"),
    ],
)
def test_verify_refuses_a_report_it_cannot_trust_with_exit_2(audited, tmp_path, capsys, edit, fragment):
    report = json.loads(audited.read_text())
    edit(report)
    (tmp_path / "report.json").write_text(json.dumps(report))
    code, _, err = run_cli(["verify", tmp_path / "report.json"], capsys)
    assert code == 2 and fragment in err and "Traceback" not in err


def test_verify_needs_the_files_to_exist_and_to_have_been_audited(audited, tmp_path, capsys):
    code, _, err = run_cli(["verify", audited, "--model", tmp_path / "gone.onnx"], capsys)
    assert code == 2 and "not found" in err
    code, _, err = run_cli(["verify", audited, "--top-model", MODEL], capsys)
    assert code == 2 and "records no top-model input" in err


def test_recompute_reproduces_the_dfil_inside_its_interval_and_flags_one_outside(audited, tmp_path, capsys):
    code, out, _ = run_cli(["verify", audited, "--recompute"], capsys)
    assert code == 0 and "inside the report's interval" in out
    report = json.loads(audited.read_text())
    mean = report["dfil"]["mean"]
    report["dfil"]["mean_ci"] = [mean * 1.5, mean * 2.0]  # an interval the measurement does not fall in
    (tmp_path / "report.json").write_text(json.dumps(report))
    code, out, err = run_cli(["verify", tmp_path / "report.json", "--recompute"], capsys)
    assert code == 1 and "does not reproduce" in err and "OUTSIDE" in out


def test_inside_widens_by_the_stated_tolerance_and_compares_infinities():
    assert inside(1.00005, 1.0, 1.0) and not inside(1.001, 1.0, 1.0)
    assert inside(float("inf"), float("inf"), float("inf")) and not inside(5.0, float("inf"), float("inf"))


def test_file_digest_reads_in_chunks_and_matches_hashlib(tmp_path, monkeypatch):
    monkeypatch.setattr("splitaudit.inputs.digests.CHUNK_BYTES", 7)
    data = os.urandom(1000)
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_folder_digest_is_sha256sum_of_its_sorted_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "1.png").write_bytes(b"one")
    (tmp_path / "a.png").write_bytes(b"two")
    listing = "".join(
        f"{hashlib.sha256(content).hexdigest()}  {name}\n" for name, content in [("a.png", b"two"), ("b/1.png", b"one")]
    )
    assert folder_sha256(tmp_path) == (hashlib.sha256(listing.encode()).hexdigest(), 2, 6)
    before = folder_sha256(tmp_path)[0]
    (tmp_path / "b" / "1.png").rename(tmp_path / "b" / "2.png")
    assert folder_sha256(tmp_path)[0] != before


def test_onnx_external_data_is_hashed_and_verified_beside_the_model(tmp_path, capsys):
    proto = onnx.load(MODEL)
    onnx.save(proto, tmp_path / "big.onnx", save_as_external_data=True, location="big.weights", size_threshold=0)
    inputs = InputFiles.before_loading(AuditOptions(model=str(tmp_path / "big.onnx"), aux=DATA))
    records = inputs.hash_all()
    assert [r["role"] for r in records] == ["model", "model-external-data", "aux"]
    assert records[1]["location"] == "big.weights" and records[1]["sha256"] == sha256_of(tmp_path / "big.weights")
    inputs.confirm_unchanged()


def test_a_file_rewritten_during_the_audit_is_refused(tmp_path):
    shutil.copy(DATA, tmp_path / "data.npz")
    inputs = InputFiles.before_loading(AuditOptions(model=MODEL, aux=str(tmp_path / "data.npz")))
    inputs.hash_all()
    with open(tmp_path / "data.npz", "ab") as stream:
        stream.write(b"\0")
    with pytest.raises(InputError, match="changed while it was being audited"):
        inputs.confirm_unchanged()


def test_html_and_markdown_show_the_fingerprint_files_and_a_sign_off_block(audited, tmp_path, capsys):
    code, _, _ = run_cli(["render", audited, "--format", "html,md", "--out", tmp_path], capsys)
    assert code == 0
    quoted = json.loads(audited.read_text())["provenance"]["fingerprint"]
    for name in ("report.html", "report.md"):
        page = (tmp_path / name).read_text()
        assert page.count(quoted) >= 3, name  # under the title, in the provenance section, in the statement
        assert sha256_of(MODEL) in page and "Sign-off" in page and "Signature" in page


def test_a_file_removed_before_it_is_hashed_is_bad_input_not_a_crash(tmp_path):
    shutil.copy(DATA, tmp_path / "data.npz")
    inputs = InputFiles.before_loading(AuditOptions(model=MODEL, aux=str(tmp_path / "data.npz")))
    (tmp_path / "data.npz").unlink()
    with pytest.raises(InputError, match="could not be read again to record its digest"):
        inputs.hash_all()


def test_a_sweep_shows_its_fingerprint_and_sign_off_too(tmp_path, capsys):
    from datetime import datetime, timezone

    from splitaudit.core.version import __version__
    from splitaudit.engine.provenance import provenance_section
    from splitaudit.inputs.digests import digest_record

    sweep = json.loads((Path(__file__).parent / "fixtures" / "tabular_sweep.json").read_text())
    files = [digest_record("model", Path(MODEL)), digest_record("aux", Path(DATA))]
    options = AuditOptions(model=MODEL, aux=DATA)
    sweep["tool"]["version"] = __version__
    sweep["provenance"] = provenance_section(
        options, files, torch.device("cpu"), [0], None, None, datetime.now(timezone.utc)
    )
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    code, _, _ = run_cli(["render", tmp_path / "sweep.json", "--format", "html,md"], capsys)
    assert code == 0
    for name in ("sweep.html", "sweep.md"):
        page = (tmp_path / name).read_text()
        assert page.count(sweep["provenance"]["fingerprint"]) >= 3 and "Signature" in page, name


def test_a_ray_run_is_measured_again_in_this_process():
    """verify --recompute measures locally: the recorded Ray cluster goes with the Ray executor
    (validate refuses --ray-address without --executor ray)."""
    recorded = {"model": "m.onnx", "aux": "a.npz", "executor": "ray", "ray_address": "auto", "workers": 1}
    options = recorded_options({"options": recorded}, [], device=None)
    assert (options.executor, options.ray_address, options.attacks) == ("local", None, ["none"])
