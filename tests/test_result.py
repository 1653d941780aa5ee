"""The result schema on real pipeline output: validation, the shipped schema, render/compare
rejecting broken files, and reports that read the gate's and the leakage stage's decisions."""

from __future__ import annotations

import copy
import json
import re

import pytest
from jsonschema import Draft202012Validator
from test_reports import empty_html_sections, empty_markdown_sections

from splitaudit import cli
from splitaudit.core.result import SCHEMA_VERSION, first_error, json_schema, shipped_schema
from splitaudit.reports import load_result, write_reports
from splitaudit.reports.files import to_strict_json
from splitaudit.reports.view import build_view
from splitaudit.reports.view_verdict import CAUSE_WORDS
from splitaudit.verdicts.gate import evaluate_gate


def run_cli(args) -> int:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    return exit_info.value.code


@pytest.fixture
def real(real_audit) -> dict:
    """A private copy of the session's real audit result."""
    return copy.deepcopy(real_audit.data)


def test_the_shipped_schema_is_the_generated_one_and_a_valid_schema():
    """Regenerate with `python -m splitaudit.core.result > audit/report.schema.json` after changing a TypedDict."""
    assert shipped_schema() == json.loads(json.dumps(json_schema()))
    Draft202012Validator.check_schema(shipped_schema())
    assert shipped_schema()["properties"]["schema_version"] == {"enum": [SCHEMA_VERSION]}


def test_schema_command_prints_the_shipped_schema(capsys):
    assert run_cli(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == shipped_schema()


def test_real_audit_output_validates_and_round_trips(real_audit, tmp_path):
    """Every file the pipeline writes validates; reading it back gives the same result."""
    assert first_error(to_strict_json(real_audit.data)) is None
    paths = real_audit.write(tmp_path, ["json", "html", "md", "sarif"])
    assert [p.name for p in paths] == ["report.html", "report.md", "report.sarif", "report.json"]  # report.json last
    stored = json.loads((tmp_path / "report.json").read_text())
    assert first_error(stored) is None
    assert to_strict_json(load_result(tmp_path / "report.json")) == stored
    html, md = (
        (tmp_path / "report.html").read_text(encoding="utf-8"),
        (tmp_path / "report.md").read_text(encoding="utf-8"),
    )
    assert empty_html_sections(html) == [] and empty_markdown_sections(md) == []


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("dfil", "mean"), "abc", "/dfil/mean: expected number, got 'abc'"),
        (("dfil", "mean"), [1.0], "/dfil/mean: expected number"),
        (("data", "classes"), "ten", "/data/classes: expected integer or null"),
        (("attacks", "kmeans", "status"), "done", '/attacks/kmeans/status: expected one of "ok", "skipped", "failed"'),
        (("gate", "checks", 0, "cause"), None, "/gate/checks/0/cause: expected one of"),
    ],
)
def test_first_error_names_the_offending_path(real, path, value, message):
    *parents, last = path
    node = real
    for key in parents:
        node = node[key]
    node[last] = value
    assert first_error(to_strict_json(real)).startswith(message)


def test_missing_and_unknown_keys_are_errors(real):
    del real["gate"]["checks"]
    assert first_error(to_strict_json(real)) == "/gate: 'checks' is missing"
    real = {**real, "gate": {**real["gate"], "checks": []}, "privacy_score": 0.9}
    assert first_error(to_strict_json(real)) == "/: unexpected key 'privacy_score'"


def test_non_finite_numbers_are_stored_as_strings_and_validate(real):
    real["dfil"]["mean"] = float("inf")
    real["bounds"]["van_trees_stderr"] = float("nan")
    assert first_error(to_strict_json(real)) is None


def test_a_result_that_breaks_the_schema_is_never_written(real, tmp_path):
    real["bounds"]["leakiest"] = []  # a key nothing in the schema declares
    with pytest.raises(RuntimeError, match="/bounds: unexpected key 'leakiest'"):
        write_reports(real, tmp_path, ["json"])
    assert not (tmp_path / "report.json").exists()


def test_render_and_compare_reject_an_invalid_report_with_exit_2(real_audit, tmp_path, capsys):
    good = tmp_path / "good" / "report.json"
    real_audit.write(good.parent, ["json"])
    stored = json.loads(good.read_text())
    stored["dfil"]["mean"] = "high"
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps(stored))
    assert run_cli(["render", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"splitaudit: error: {bad}: /dfil/mean: expected number, got 'high'"
    assert not (tmp_path / "report.html").exists()
    assert run_cli(["compare", str(good), str(bad), "--out", str(tmp_path / "cmp")]) == 2
    assert "/dfil/mean: expected number" in capsys.readouterr().err
    assert run_cli(["render", str(good)]) == 0


def test_every_failed_check_has_a_recorded_cause_the_headline_reads(real):
    gate = real["gate"]
    failed = [c for c in gate["checks"] if not c["passed"]]
    assert failed and all(c["severity"] == "error" for c in failed)
    assert all(c["severity"] == "none" for c in gate["checks"] if c["passed"])
    headline = build_view(real, with_figures=False).headline
    causes = "; ".join(dict.fromkeys(CAUSE_WORDS[c["cause"]] for c in failed))
    assert real["run"]["quick"] and headline == f"FAILED: {causes} [QUICK RUN: lower bounds on leakage]"


def test_bound_beaten_and_twice_too_low_is_untrusted_in_gate_and_headline(real):
    """The bound is beaten by an attack and below the threshold: the gate says it is untrustworthy,
    and the report shows the gate's verdict rather than deciding again (which would call it merely
    too low)."""
    bound = real["bounds"]["van_trees_mse"]
    assert real["bounds"]["violated_by"], "the real audit is expected to beat its smoothed bound"
    real["gate"] = evaluate_gate(real, fail_under_mse=2 * bound)
    check = next(c for c in real["gate"]["checks"] if c["name"] == "fail-under-mse")
    assert check["cause"] == "bound-untrusted" and "not trustworthy" in check["message"]
    assert build_view(real, with_figures=False).headline.startswith("FAILED: the provable bound cannot be trusted")
    real["bounds"]["violated_by"] = []
    real["gate"] = evaluate_gate(real, fail_under_mse=2 * bound)
    assert build_view(real, with_figures=False).headline.startswith("FAILED: the provable bound is too low")


def test_violation_causes_come_from_the_result(real, tmp_path):
    causes = real["bounds"]["violation_causes"]
    assert causes and any("smooth" in c for c in causes)  # digits are [0,1] images: smoothed bound
    real["bounds"]["violation_causes"] = ["a cause only this result states"]
    write_reports(real, tmp_path, ["html", "md"])
    html, md = (
        (tmp_path / "report.html").read_text(encoding="utf-8"),
        (tmp_path / "report.md").read_text(encoding="utf-8"),
    )
    bounds_html = html.split('id="bounds"')[1].split("</section>")[0]
    assert "Likely causes: a cause only this result states." in re.sub(r"\s+", " ", bounds_html)
    assert "Likely causes: a cause only this result states." in re.sub(r"\s+", " ", md)
    assert "prior term is too small" not in html + md


def test_leakiest_samples_table_shows_what_the_pipeline_writes(real_audit, tmp_path):
    leakiest = real_audit.data["dfil"]["leakiest"]
    view = build_view(real_audit.data, with_figures=False)
    assert view.bounds.leakiest.headers == ["index", "dfil", "jacobian sq norm"]
    assert [row[0] for row in view.bounds.leakiest.rows] == [str(s["index"]) for s in leakiest]


def test_hostile_files_are_input_errors(real_audit, tmp_path):
    from splitaudit.core.errors import InputError

    stored = json.loads(real_audit.to_json())
    cases = {"list.json": "[1, 2]", "latin1.json": b"\xff\xfe{}", "deep.json": None}
    stored["attacks"]["kmeans"]["details"]["nest"] = "@"
    cases["deep.json"] = json.dumps(stored).replace('"@"', "[" * 5000 + "]" * 5000)
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(InputError, match="is not a splitaudit report.json"):
            load_result(path)


def test_every_failing_cause_has_words_for_the_headline():
    from typing import get_args

    from splitaudit.core.result import CheckCause

    passing = {"complete", "bound-met", "attack-mse-met", "advantage-within-cap", "utility-loss-within-cap"}
    passing |= {"baseline-same-inputs", "baseline-other-inputs", "regression-within", "regression-not-comparable"}
    assert set(CAUSE_WORDS) == set(get_args(CheckCause)) - passing
