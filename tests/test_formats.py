"""Conformance suite of the report-format registry (splitaudit.core.registries.FORMATS): every format
writes, from a saved result alone, each document it declares, through the same command a user
runs (`splitaudit render` for a report or a sweep, `compare` for a comparison), and the file
parses as what it claims to be; a format a document does not declare is one line and exit 2.
A new format runs here by its registry line alone (add its parser to PARSES)."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from splitaudit.cli import main
from splitaudit.core import registries
from splitaudit.core.config import AuditOptions
from splitaudit.core.registries import DEFAULT_FORMATS, FORMATS, ReportFormat, formats_of
from splitaudit.core.result import SCHEMA_VERSION
from splitaudit.reports.writer import load_result

FIXTURES = Path(__file__).parent / "fixtures"
SAVED = {"report": "image_audit.json", "sweep": "tabular_sweep.json", "cuts": "resnet_cuts.json"}


def _html(path: Path) -> None:
    text = path.read_text()
    assert text.lstrip().lower().startswith("<!doctype html") and "</html>" in text


def _md(path: Path) -> None:
    assert path.read_text().startswith("#")


def _json(path: Path) -> None:
    if path.name != "comparison.json":
        assert load_result(path)["schema_version"] == SCHEMA_VERSION  # checked against its schema
    else:
        assert isinstance(json.loads(path.read_text()), dict)


def _sarif(path: Path) -> None:
    assert json.loads(path.read_text())["version"] == "2.1.0"


def _junit(path: Path) -> None:
    suite = ET.parse(path).getroot()
    assert suite.tag == "testsuite" and int(suite.get("tests")) == len(suite.findall("testcase")) > 0


def _pdf(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(b"%PDF-") and data.rstrip().endswith(b"%%EOF")  # tests/test_pdf.py reads it back


PARSES = {"html": _html, "md": _md, "json": _json, "sarif": _sarif, "junit": _junit, "pdf": _pdf}
SUFFIX = {"html": ".html", "md": ".md", "json": ".json", "sarif": ".sarif", "junit": ".junit.xml", "pdf": ".pdf"}


def _cli(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def _document_args(document: str, tmp_path: Path) -> tuple[list[str], str]:
    """The command writing `document` from saved results, and the written files' stem."""
    if document == "comparison":
        before, after = FIXTURES / "sigma0_audit.json", FIXTURES / "image_audit.json"
        return ["compare", str(before), str(after)], "comparison"
    saved = tmp_path / (f"{document}.json" if document in ("sweep", "cuts") else "report.json")
    shutil.copy(FIXTURES / SAVED[document], saved)
    return ["render", str(saved)], document


def test_every_format_has_a_parser_here():
    assert set(PARSES) == set(FORMATS)


@pytest.mark.parametrize(
    "name, document", [(name, doc) for name, fmt in FORMATS.items() for doc in sorted(fmt.documents)]
)
def test_every_format_writes_every_document_it_declares(name, document, tmp_path, capsys):
    args, stem = _document_args(document, tmp_path)
    out = tmp_path / "out"
    assert _cli([*args, "--format", name, "--out", str(out)]) == 0, capsys.readouterr().err
    written = sorted(p.name for p in out.iterdir() if p.is_file() and not p.name.startswith("."))
    assert written == [stem + SUFFIX[name]]
    PARSES[name](out / written[0])


@pytest.mark.parametrize(
    "name, document",
    [
        (name, doc)
        for name, fmt in FORMATS.items()
        for doc in ("report", "sweep", "comparison")
        if doc not in fmt.documents
    ],
)
def test_a_format_a_document_does_not_declare_is_refused(name, document, tmp_path, capsys):
    args, _ = _document_args(document, tmp_path)
    assert _cli([*args, "--format", f"html,{name}", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"--format takes a comma list of {', '.join(formats_of(document))} for a {document}" in err


def test_defaults_come_from_the_registry():
    assert tuple(AuditOptions().formats) == DEFAULT_FORMATS == ("html", "md", "json")


def write_toy(document, out_dir: Path) -> Path:
    """A toy format's writer: the document's kind and headline, one line (test_a_format_added_by_its_registry_line)."""
    path = out_dir / f"{document.kind}.toy"
    path.write_text(f"{document.kind}: {document.view.headline}\n", encoding="utf-8")
    return path


def test_a_format_added_by_its_registry_line_is_a_choice_and_is_written(tmp_path, capsys, monkeypatch):
    """One registry line (name, words, documents, writer) and its writer: `render --format toy` writes it
    for the documents it declares, beside the others in registry order, and refuses it for the rest."""
    toy = ReportFormat("toy", "a toy format", frozenset({"report", "sweep"}), ("test_formats", "write_toy"))
    monkeypatch.setitem(registries.FORMATS, "toy", toy)
    for document in ("report", "sweep"):
        (tmp_path / document).mkdir()
        args, stem = _document_args(document, tmp_path / document)
        out = tmp_path / document / "out"
        assert _cli([*args, "--format", "toy,json", "--out", str(out)]) == 0, capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir() if p.is_file()) == [f"{stem}.json", f"{stem}.toy"]
        assert (out / f"{stem}.toy").read_text().startswith(f"{stem}: ")
    args, _ = _document_args("comparison", tmp_path)
    assert _cli([*args, "--format", "toy", "--out", str(tmp_path / "c")]) == 2
    assert "--format takes a comma list of html, md, json for a comparison" in capsys.readouterr().err
