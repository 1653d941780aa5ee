"""The CI gate: each check's verdict and message, and the exit codes through the real CLI entry point."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from splitaudit import cli
from splitaudit.engine import pipeline
from splitaudit.reports import load_result
from splitaudit.verdicts.gate import evaluate_gate

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> dict:
    result = load_result(FIXTURES / f"{name}.json")
    del result["gate"]
    return result


def check(gate: dict, name: str) -> dict:
    return next(c for c in gate["checks"] if c["name"] == name)


def test_no_thresholds_passes_a_complete_audit():
    gate = evaluate_gate(fixture("image_audit"))
    assert gate["passed"] and gate["reasons"] == []
    assert [c["name"] for c in gate["checks"]] == ["audit-complete"]


def test_failed_attack_makes_the_audit_incomplete_even_without_thresholds():
    gate = evaluate_gate(fixture("failed_attack_audit"))
    assert not gate["passed"]
    assert gate["reasons"] == ["audit incomplete: attack(s) failed: sdar"]


def test_bound_below_threshold_says_by_how_much():
    result = fixture("image_audit")  # van Trees bound 0.0658
    gate = evaluate_gate(result, fail_under_mse=0.1)
    bound = check(gate, "fail-under-mse")
    assert not gate["passed"] and bound["value"] == pytest.approx(0.0658, abs=1e-4) and bound["threshold"] == 0.1
    assert "short by 0.0342" in bound["message"]
    assert evaluate_gate(result, fail_under_mse=0.05)["passed"]


def test_zero_bound_fails_any_positive_threshold():
    gate = evaluate_gate(fixture("sigma0_audit"), fail_under_mse=1e-6)
    assert not gate["passed"] and check(gate, "fail-under-mse")["value"] == 0


@pytest.mark.parametrize("bounds", [{}, {"van_trees_mse": math.nan}])
def test_a_missing_or_nan_bound_fails_the_bound_gate(bounds):
    result = fixture("image_audit")
    result["bounds"] = bounds
    gate = evaluate_gate(result, fail_under_mse=0.01)
    assert not gate["passed"] and "no van Trees bound" in gate["reasons"][0]


def test_a_violated_bound_fails_the_bound_gate_whatever_its_value():
    gate = evaluate_gate(fixture("blackbox_audit"), fail_under_mse=0.001)
    assert not gate["passed"]
    assert "not trustworthy" in check(gate, "fail-under-mse")["message"]


def test_attack_mse_floor_uses_the_best_reconstruction_attack():
    result = fixture("image_audit")  # decoder 0.0747 is the best of decoder/optimization/sdar
    gate = evaluate_gate(result, fail_under_attack_mse=0.08)
    floor = check(gate, "fail-under-attack-mse")
    assert not floor["passed"] and "decoder" in floor["message"]
    assert floor["value"] == pytest.approx(result["attacks"]["decoder"]["metrics"]["mse"])
    assert evaluate_gate(result, fail_under_attack_mse=0.07)["passed"]


def test_attack_mse_floor_fails_when_no_reconstruction_attack_ran():
    result = fixture("image_audit")
    for name in ("decoder", "optimization", "sdar"):
        del result["attacks"][name]
    gate = evaluate_gate(result, fail_under_attack_mse=0.01)
    assert not gate["passed"] and "cannot be checked" in gate["reasons"][0]


def test_advantage_cap_gives_one_check_per_attack_that_ran():
    result = fixture("blackbox_audit")  # optimization and sdar were skipped
    gate = evaluate_gate(result, max_advantage=0.4)
    names = [c["name"] for c in gate["checks"] if c["name"].startswith("max-advantage")]
    assert names == [
        "max-advantage:fine-tune",
        "max-advantage:kmeans",
        "max-advantage:attribute",
        "max-advantage:decoder",
    ]
    assert [c["name"] for c in gate["checks"] if not c["passed"]] == [
        "max-advantage:attribute",
        "max-advantage:decoder",
    ]


def test_non_finite_advantage_is_not_gated():
    result = fixture("image_audit")
    result["attacks"]["kmeans"]["advantage"] = math.nan
    gate = evaluate_gate(result, max_advantage=0.9)
    assert "max-advantage:kmeans" not in [c["name"] for c in gate["checks"]]


# --- exit codes through splitaudit.cli.main ------------------------------------------------------


@pytest.fixture
def fake_audit(monkeypatch):
    """Replace the pipeline by the image fixture, gated with the thresholds the CLI passes on."""

    def run_audit(options, progress=None, on_cost=None, invocation=None, baseline=None, on_notice=None):
        result = fixture("image_audit")
        result["gate"] = evaluate_gate(
            result,
            fail_under_mse=options.fail_under_mse,
            fail_under_attack_mse=options.fail_under_attack_mse,
            max_advantage=options.max_advantage,
        )
        return result

    monkeypatch.setattr(pipeline, "run_audit", run_audit)


def exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    return exc.value.code


def test_exit_0_when_every_gate_passes(fake_audit, tmp_path, capsys):
    assert (
        exit_code(
            [
                "run",
                "model.onnx",
                "--aux",
                "data.npz",
                "--out",
                str(tmp_path),
                "--format",
                "json",
                "--fail-under-mse",
                "0.01",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "PASSED" in out and "decoder" in out


def test_exit_1_when_a_gate_fails_and_every_report_is_still_written(fake_audit, tmp_path, capsys):
    junit = tmp_path / "gates.xml"
    code = exit_code(
        [
            "run",
            "model.onnx",
            "--aux",
            "data.npz",
            "--out",
            str(tmp_path / "out"),
            "--fail-under-mse",
            "0.5",
            "--max-advantage",
            "0.3",
            "--junit",
            str(junit),
        ]
    )
    assert code == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "report.html",
        "report.json",
        "report.md",
        "report_images",
    ]
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["gate"]["passed"] is False and saved["gate"]["fail_under_mse"] == 0.5
    assert "short by" in (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    suite = ET.parse(junit).getroot()
    assert suite.get("failures") == "3"  # the bound, attribute's and decoder's advantage
    quick = saved["run"]["quick"]
    assert suite.find("properties/property[@name='quick']").get("value") == str(quick).lower()
    assert ("quick" in suite.get("name")) is quick and (suite.find("system-out") is not None) is quick
    assert "FAILED" in capsys.readouterr().out


def test_gate_thresholds_come_from_the_config_file(fake_audit, tmp_path):
    config = tmp_path / "audit.toml"
    config.write_text('fail_under_attack_mse = 0.09\nformats = ["json"]\n')
    argv = ["run", "model.onnx", "--aux", "data.npz", "--out", str(tmp_path), "--config", str(config)]
    assert exit_code(argv) == 1
    assert exit_code(argv + ["--fail-under-attack-mse", "0.01"]) == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "model.onnx"],  # no --aux
        ["run", "model.onnx", "--aux", "d.npz", "--format", "docx"],
        ["run", "model.onnx", "--aux", "d.npz", "--fail-under-mse", "-1"],
        ["render", "missing.json"],
    ],
)
def test_exit_2_on_bad_usage_with_one_line_and_no_traceback(fake_audit, argv, capsys):
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitaudit: error: ") and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "name, thresholds, check_name, cause",
    [
        ("image_audit", {}, "audit-complete", "complete"),
        ("failed_attack_audit", {}, "audit-complete", "incomplete"),
        ("image_audit", {"fail_under_mse": 0.1}, "fail-under-mse", "bound-too-low"),
        ("image_audit", {"fail_under_mse": 0.05}, "fail-under-mse", "bound-met"),
        ("blackbox_audit", {"fail_under_mse": 0.001}, "fail-under-mse", "bound-untrusted"),
        ("image_audit", {"fail_under_attack_mse": 0.08}, "fail-under-attack-mse", "attack-mse-too-low"),
        ("image_audit", {"fail_under_attack_mse": 0.07}, "fail-under-attack-mse", "attack-mse-met"),
        ("image_audit", {"max_advantage": 0.01}, "max-advantage:decoder", "advantage-too-high"),
    ],
)
def test_each_check_records_its_cause_and_severity(name, thresholds, check_name, cause):
    """The gate decides once; reports and SARIF read `cause` and `severity` (error when failed)."""
    found = check(evaluate_gate(fixture(name), **thresholds), check_name)
    assert found["cause"] == cause
    assert found["severity"] == ("none" if found["passed"] else "error")


def test_bound_gate_does_not_pass_on_a_failed_prior_that_fell_back_to_the_floor():
    """Without smoothing a failed low J/d falls back to the Gaussian floor, a lower limit on J only:
    the bound may be too optimistic, so the bound gate fails naming the prior; with Stam's limit it may pass."""
    result = fixture("image_audit")
    threshold = result["bounds"]["van_trees_mse"] / 2
    floor = dict(result["prior"], valid=False, stam_limit=None, J_over_d_used=7.0)
    gate = evaluate_gate(dict(result, prior=floor), fail_under_mse=threshold)
    assert not gate["passed"] and check(gate, "fail-under-mse")["cause"] == "prior-untrusted"
    stam = dict(result["prior"], valid=False, stam_limit=16.0, J_over_d_used=16.0)
    assert check(evaluate_gate(dict(result, prior=stam), fail_under_mse=threshold), "fail-under-mse")["passed"]


def test_junit_of_a_quick_run_is_named_and_warned_as_one(tmp_path):
    """CI views of a --quick audit's passed gates must not read as a full audit's."""
    from splitaudit.reports import write_junit
    from splitaudit.reports.view_verdict import QUICK_ALERT

    checks = [{"name": "audit-complete", "passed": True, "message": "every selected attack ran"}]
    for quick in (True, False):
        suite = ET.parse(
            write_junit({"gate": {"checks": checks}, "run": {"quick": quick}}, tmp_path / "g.xml")
        ).getroot()
        assert suite.get("name") == ("splitaudit (quick run)" if quick else "splitaudit")
        assert suite.find("properties/property[@name='quick']").get("value") == str(quick).lower()
        assert [e.text for e in suite.findall("system-out")] == ([QUICK_ALERT] if quick else [])
        assert [case.tag for case in suite][-1] == ("system-out" if quick else "testcase")
