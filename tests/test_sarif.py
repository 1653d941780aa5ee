"""SARIF 2.1.0 output, validated against the official OASIS schema (tests/fixtures/sarif/)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from jsonschema import Draft4Validator

from splitaudit.reports.sarif import sarif_log, write_sarif
from splitaudit.verdicts.gate import evaluate_gate

SARIF_SCHEMA = json.loads((Path(__file__).parent / "fixtures" / "sarif" / "sarif-schema-2.1.0.json").read_text())


def sarif_errors(log: dict) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in Draft4Validator(SARIF_SCHEMA).iter_errors(log)]


def test_failed_checks_and_violations_become_results_at_the_model_file(real_audit, tmp_path):
    result = real_audit.data
    log = json.loads(write_sarif(result, tmp_path / "report.sarif").read_text())
    assert sarif_errors(log) == []
    run = log["runs"][0]
    failed = [c for c in result["gate"]["checks"] if not c["passed"]]
    violated = result["bounds"]["violated_by"]
    assert failed and violated  # the session audit fails its gate and beats its bound
    assert len(run["results"]) == len(failed) + len(violated)
    rules = [r["id"] for r in run["tool"]["driver"]["rules"]]
    assert len(rules) == len(set(rules))
    for finding in run["results"]:
        assert rules[finding["ruleIndex"]] == finding["ruleId"]
        uri = finding["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
        assert uri.endswith("digits_cnn.pt")
    by_check = {f["properties"]["check"]: f for f in run["results"] if "check" in f["properties"]}
    for check in failed:
        finding = by_check[check["name"]]
        assert finding["level"] == "error" and finding["properties"]["cause"] == check["cause"]
        assert check["message"] in finding["message"]["text"]
    warnings = [f for f in run["results"] if f["ruleId"] == "bound-violated"]
    assert [f["properties"]["attack"] for f in warnings] == violated
    assert all(
        f["level"] == "warning" and result["bounds"]["violation_causes"][0] in f["message"]["text"] for f in warnings
    )


def test_fingerprints_are_stable_across_runs(real_audit):
    first, again = sarif_log(real_audit.data), sarif_log(copy.deepcopy(real_audit.data))
    prints = [r["partialFingerprints"] for r in first["runs"][0]["results"]]
    assert prints == [r["partialFingerprints"] for r in again["runs"][0]["results"]]
    assert len({p["splitaudit/v1"] for p in prints}) == len(prints)


def test_a_passing_audit_gives_a_valid_log_with_no_results(real_audit):
    result = copy.deepcopy(real_audit.data)
    result["bounds"]["violated_by"] = []
    result["gate"] = evaluate_gate(result)
    log = sarif_log(result)
    assert sarif_errors(log) == [] and log["runs"][0]["results"] == []


def test_model_path_is_relative_to_the_source_root_when_inside_it(real_audit, tmp_path):
    result = copy.deepcopy(real_audit.data)
    model = tmp_path / "models dir" / "bottom.onnx"
    result["model"]["path"] = str(model)

    def artifact(base: Path) -> dict:
        return sarif_log(result, base)["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]

    assert artifact(tmp_path) == {"uri": "models%20dir/bottom.onnx", "uriBaseId": "%SRCROOT%"}
    assert artifact(tmp_path / "elsewhere") == {"uri": model.as_uri()}
    assert model.as_uri().endswith("/models%20dir/bottom.onnx")


def test_a_quick_run_says_so_in_the_log_and_a_full_run_does_not(real_audit):
    """A code-scanning view of a --quick audit with no findings must not read as a full audit's."""
    from splitaudit.reports.view_verdict import QUICK_ALERT

    for quick in (True, False):
        result = copy.deepcopy(real_audit.data)
        result["run"]["quick"] = quick
        log = sarif_log(result)
        run = log["runs"][0]
        notes = run["invocations"][0]["toolExecutionNotifications"]
        assert sarif_errors(log) == [] and run["properties"]["quick"] is quick
        assert [n["message"]["text"] for n in notes] == ([QUICK_ALERT] if quick else [])
