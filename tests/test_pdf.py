"""report.pdf (--format pdf, also for render): read back with pypdf, the PDF holds the HTML view's
verdict, findings and charts, the provenance fingerprint on every page, and the sign-off block."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import sample

from splitaudit.cli import main
from splitaudit.reports.view import build_view
from splitaudit.reports.writer import load_result

pypdf = pytest.importorskip("pypdf")

FIXTURES = Path(__file__).parent / "fixtures"
MODEL, DATA = sample("digits_cnn.onnx"), sample("digits.npz")


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def words(text: str) -> str:
    """Text with every run of whitespace as one space (the PDF wraps lines where the HTML does not)."""
    return re.sub(r"\s+", " ", text).strip()


def read_pdf(path: Path) -> tuple[list[str], int]:
    reader = pypdf.PdfReader(io.BytesIO(path.read_bytes()))
    return [page.extract_text() for page in reader.pages], sum(len(page.images) for page in reader.pages)


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """A real quick audit of the sample CNN (k-means) with a bound gate, written as JSON, HTML and PDF."""
    out = tmp_path_factory.mktemp("pdf")
    args = ["run", MODEL, "--aux", DATA, "--attacks", "kmeans", "--quick", "--prior", "gaussian"]
    args += ["--dfil-samples", "64", "--noise-sigma", "0.5", "--fail-under-mse", "0.01"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--format", "json,html,pdf", "--out", str(out)])
    assert exit_info.value.code == 0
    return out


def test_the_pdf_holds_the_verdict_findings_charts_provenance_and_sign_off(audited):
    result = json.loads((audited / "report.json").read_text())
    view = build_view(load_result(audited / "report.json"))
    pages, images = read_pdf(audited / "report.pdf")
    text = words(" ".join(pages))
    fingerprint = result["provenance"]["fingerprint"]
    assert len(pages) >= 3 and images >= 1  # the dFIL histogram at least
    assert words(view.headline) in text and "PASSED" in view.headline
    for item in view.summary:
        assert words(item.label) in text
    for heading in ("Attacks at a glance", "Gate checks", "What can provably be recovered", "Clustering (k-means)"):
        assert heading in text
    assert "Assumptions and limitations" in text and "Provenance and sign-off" in text
    assert all(f"fingerprint {fingerprint}" in words(page) for page in pages)  # every page's footer
    assert result["provenance"]["files"][0]["sha256"][:20] in text.replace(" ", "")
    assert "Signature" in text and "Reviewer" in text and f"(fingerprint {fingerprint})" in text


def test_render_writes_the_pdf_of_a_saved_report_and_only_of_a_report(audited, tmp_path, capsys):
    shutil.copy(audited / "report.json", tmp_path / "report.json")
    code, out, _ = run_cli(["render", tmp_path / "report.json", "--format", "pdf"], capsys)
    assert code == 0 and "report.pdf" in out
    assert read_pdf(tmp_path / "report.pdf")[0][0] == read_pdf(audited / "report.pdf")[0][0]
    shutil.copy(FIXTURES / "tabular_sweep.json", tmp_path / "sweep.json")
    code, _, err = run_cli(["render", tmp_path / "sweep.json", "--format", "pdf"], capsys)
    assert code == 2 and "--format takes" in err


def test_an_image_audit_draws_its_reconstructions_and_says_it_has_no_provenance(tmp_path, capsys):
    shutil.copy(FIXTURES / "image_audit.json", tmp_path / "report.json")
    code, _, _ = run_cli(["render", tmp_path / "report.json", "--format", "pdf,html"], capsys)
    assert code == 0
    pages, images = read_pdf(tmp_path / "report.pdf")
    html_images = (tmp_path / "report.html").read_text().count("<img")
    assert images == html_images >= 4  # bound chart, dFIL histogram, reconstruction grids: the HTML's figures
    text = words(" ".join(pages))
    assert "records no provenance" in text and "Learned inversion" in text
