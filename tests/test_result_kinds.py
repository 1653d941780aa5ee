"""Conformance suite of the result-kind registry (splitaudit.core.registries.RESULT_KINDS): every kind
names a schema, a writer, a consistency check, a gate and a re-measurement that exist; a saved document
of each kind is read against its own schema, re-rendered by `splitaudit render` and refused by
`compare` where it is not a report; and an older (schema 5) document is re-gated by its own kind's rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import run_cli

from splitaudit.core.registries import RESULT_KINDS, resolve, result_kind
from splitaudit.core.result import schema_of_kind
from splitaudit.reports.writer import load_result
from splitaudit.verdicts.recommend_cut import cuts_gate

FIXTURES = Path(__file__).parent / "fixtures"
SAVED = {"report": "image_audit.json", "sweep": "tabular_sweep.json", "cuts": "resnet_cuts.json"}


def test_every_kind_has_a_saved_document_here():
    assert set(SAVED) == set(RESULT_KINDS), "add a saved document of the new kind to SAVED"


@pytest.mark.parametrize("name", list(RESULT_KINDS))
def test_every_named_function_exists(name):
    kind = RESULT_KINDS[name]
    for reference in (kind.schema, kind.writer, kind.problem, kind.gate, kind.remeasure):
        assert callable(resolve(reference)), reference


@pytest.mark.parametrize("name", list(RESULT_KINDS))
def test_a_saved_document_is_read_rendered_and_compared_by_its_kind(name, tmp_path, capsys):
    path = FIXTURES / SAVED[name]
    document = load_result(path)
    assert result_kind(document).name == name
    assert schema_of_kind(document.get("kind"))["title"].startswith(f"splitaudit {name}.json")
    code, out, err = run_cli(["render", str(path), "--format", "md", "--out", str(tmp_path / "out")], capsys)
    assert code == 0, err
    assert (tmp_path / "out" / f"{name}.md").is_file()
    code, _, err = run_cli(["compare", str(path), str(path), "--out", str(tmp_path / "cmp")], capsys)
    assert (code == 2) == bool(RESULT_KINDS[name].side_by_side), err
    if code == 2:
        assert f"is a {name}.json" in err and RESULT_KINDS[name].side_by_side in err


def test_an_older_cuts_document_is_regated_by_the_cuts_rules(tmp_path, capsys):
    """A schema 5 cuts.json whose bound gate passed on its recommended cut was re-gated by a run's rules,
    which look for a bound at the top of the document, and rendered as failing ("no van Trees bound
    was computed"); re-gated by its own kind's rules it still passes."""
    document = load_result(FIXTURES / SAVED["cuts"])
    threshold = document["recommendation"]["van_trees_mse"] / 2
    gate = cuts_gate(document, fail_under_mse=threshold, fail_under_attack_mse=None, max_advantage=None, strict=False)
    assert gate["passed"]
    stored = json.loads((FIXTURES / SAVED["cuts"]).read_text())
    stored["schema_version"], stored["gate"] = 5, json.loads(json.dumps(gate))
    (tmp_path / "cuts.json").write_text(json.dumps(stored))
    code, _, err = run_cli(
        ["render", str(tmp_path / "cuts.json"), "--format", "json", "--out", str(tmp_path / "out")], capsys
    )
    assert code == 0, err
    rendered = json.loads((tmp_path / "out" / "cuts.json").read_text())["gate"]
    assert rendered["passed"] and any(f">= {threshold:.4g}" in c["message"] for c in rendered["checks"])
