"""The regression gate (`run --baseline`): a bound that fell, or an attack's advantage that grew, by more
than 1.96 combined standard errors fails with its own cause; the same audit passes; `compare` shows the
same verdict; the saved report recomputes its gate from the baseline numbers it stores."""

from __future__ import annotations

import json
import math

import pytest
from conftest import sample

from splitaudit.cli import main
from splitaudit.core.result import first_error
from splitaudit.verdicts.gate import evaluate_gate
from splitaudit.verdicts.regression import Z, baseline_summary, compare_to_baseline

MODEL, DATA = sample("digits_cnn.onnx"), sample("digits.npz")
QUICK = ["--aux", DATA, "--attacks", "kmeans", "--quick", "--prior", "gaussian", "--dfil-samples", "64"]


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def audit(bound: float, bound_se: float | None, attacks: dict, sigma: float = 0.5, model: str = "a" * 64) -> dict:
    """A result with what the regression test reads: the bound, its stderr, attacks and digests."""
    return {
        "noise_sigma": sigma,
        "bounds": {"van_trees_mse_point": bound, "van_trees_mse": bound * 0.9, "van_trees_stderr": bound_se},
        "attacks": attacks,
        "provenance": {"files": [{"role": "model", "sha256": model}, {"role": "aux", "sha256": "b" * 64}]},
    }


def attack(advantage: float, std: float | None = None, seeds: int = 3, outcome: str = "leakage") -> dict:
    return {
        "status": "ok",
        "outcome": outcome,
        "advantage": advantage,
        "advantage_std": std,
        "seeds": list(range(seeds)),
    }


def test_the_bound_regresses_only_beyond_1_96_combined_standard_errors():
    allowed = Z * math.hypot(0.003, 0.004)  # 0.0098
    baseline = baseline_summary(audit(0.05, 0.003, {}), "old.json")
    within = compare_to_baseline(baseline, audit(0.05 - 0.0097, 0.004, {}))["bound"]
    beyond = compare_to_baseline(baseline, audit(0.05 - 0.0099, 0.004, {}))["bound"]
    assert within["allowed"] == pytest.approx(allowed) and not within["regressed"]
    assert beyond["regressed"] and beyond["worse_by"] == pytest.approx(0.0099)
    assert not compare_to_baseline(baseline, audit(0.2, 0.004, {}))["bound"]["regressed"]  # a rise is no regression


def test_an_advantage_compares_by_the_standard_error_of_its_mean_over_seeds():
    baseline = baseline_summary(audit(0.05, 0.0, {"kmeans": attack(0.10, std=0.03, seeds=3)}), "old.json")
    se = 0.03 / math.sqrt(3)
    allowed = Z * math.hypot(se, se)
    rows = {
        grown: compare_to_baseline(baseline, audit(0.05, 0.0, {"kmeans": attack(0.10 + grown, 0.03, 3)}))["attacks"][0]
        for grown in (allowed * 0.99, allowed * 1.01)
    }
    assert [row["regressed"] for row in rows.values()] == [False, True]
    assert rows[allowed * 1.01]["uncertainty"] == "both measured"


def test_a_missing_uncertainty_counts_as_zero_and_is_said():
    baseline = baseline_summary(audit(0.05, None, {"kmeans": attack(0.1, None, seeds=1)}), "old.json")
    now = compare_to_baseline(baseline, audit(0.05 - 1e-6, None, {"kmeans": attack(0.1 + 1e-6, None, seeds=1)}))
    assert now["bound"]["regressed"] and now["bound"]["uncertainty"] == "none measured (0)"
    assert now["attacks"][0]["regressed"] and now["attacks"][0]["allowed"] == 0
    same = compare_to_baseline(baseline, audit(0.05, None, {"kmeans": attack(0.1, None, seeds=1)}))
    assert not same["bound"]["regressed"] and not same["attacks"][0]["regressed"]


@pytest.mark.parametrize(
    "before, after, reason",
    [
        (attack(0.1), attack(0.9, outcome="inconclusive"), "inconclusive in this audit"),
        (attack(0.1, outcome="inconclusive"), attack(0.9), "inconclusive in baseline"),
        (None, attack(0.9), "absent from baseline"),
        (attack(0.1), {"status": "skipped"}, "skipped in this audit"),
    ],
)
def test_only_attacks_that_measured_something_in_both_audits_compare(before, after, reason):
    baseline = baseline_summary(audit(0.05, 0.001, {"kmeans": before} if before else {}), "old.json")
    row = compare_to_baseline(baseline, audit(0.05, 0.001, {"kmeans": after}))["attacks"][0]
    assert not row["comparable"] and not row["regressed"] and row["reason"].startswith(reason)


def test_the_gate_says_when_the_baseline_audited_other_files():
    baseline = baseline_summary(audit(0.05, 0.001, {}), "old.json")
    result = {**audit(0.01, 0.001, {}, model="c" * 64), "attacks": {}}
    gate = evaluate_gate(result, baseline=baseline)
    checks = {c["name"]: c for c in gate["checks"]}
    assert checks["baseline-inputs"]["cause"] == "baseline-other-inputs"
    assert checks["baseline-inputs"]["severity"] == "warning" and "model file's SHA-256 differs" in gate["reasons"][0]
    assert checks["regression:bound"]["cause"] == "regression-bound" and not gate["passed"]
    assert gate["baseline"] == baseline


@pytest.fixture(scope="module")
def audits(tmp_path_factory):
    """Real quick audits of the sample CNN (k-means only): a baseline at sigma 0.5, the same audit
    against it, and a leakier one (sigma 0.2: less noise) against it; (folder, exit code) each."""
    root = tmp_path_factory.mktemp("regression")
    codes = {}
    for name, sigma, baseline in (("base", 0.5, None), ("same", 0.5, "base"), ("leaky", 0.2, "base")):
        args = ["run", MODEL, *QUICK, "--noise-sigma", sigma, "--format", "json", "--out", root / name]
        args += ["--baseline", root / baseline / "report.json"] if baseline else []
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in args])
        codes[name] = exit_info.value.code
    return root, codes


def gate_of(root, name) -> dict:
    return json.loads((root / name / "report.json").read_text())["gate"]


@pytest.mark.slow  # the module's three real audits take about 30 s
def test_the_same_model_passes_the_regression_gate(audits):
    root, codes = audits
    assert codes == {"base": 0, "same": 0, "leaky": 1}
    checks = {c["name"]: c for c in gate_of(root, "same")["checks"]}
    assert checks["baseline-inputs"]["cause"] == "baseline-same-inputs"
    assert checks["regression:bound"]["cause"] == "regression-within" and checks["regression:bound"]["value"] == 0
    assert checks["regression:kmeans"]["cause"] == "regression-within"


@pytest.mark.slow  # the module's three real audits take about 30 s
def test_less_noise_fails_the_regression_gate_with_its_own_causes(audits):
    root, _ = audits
    gate = gate_of(root, "leaky")
    checks = {c["name"]: c for c in gate["checks"]}
    assert checks["regression:bound"]["cause"] == "regression-bound" and not checks["regression:bound"]["passed"]
    assert checks["regression:bound"]["value"] > checks["regression:bound"]["threshold"] > 0
    assert "noise sigma differs (0.5 in the baseline, 0.2 here)" in checks["baseline-inputs"]["message"]
    assert (
        gate["baseline"]["bound"]
        == json.loads((root / "base" / "report.json").read_text())["bounds"]["van_trees_mse_point"]
    )
    assert first_error(json.loads((root / "leaky" / "report.json").read_text())) is None


@pytest.mark.slow  # the module's three real audits take about 30 s
def test_the_saved_report_recomputes_its_regression_gate(audits, tmp_path, capsys):
    root, _ = audits
    code, _, _ = run_cli(["render", root / "leaky" / "report.json", "--out", tmp_path / "ok"], capsys)
    assert code == 0
    report = json.loads((root / "leaky" / "report.json").read_text())
    report["gate"]["baseline"]["bound"] = 0.001  # a baseline under which the bound did not fall: the check flips
    (tmp_path / "report.json").write_text(json.dumps(report))
    code, _, err = run_cli(["render", tmp_path / "report.json", "--out", tmp_path / "bad"], capsys)
    assert code == 2 and "regression:bound" in err


@pytest.mark.slow  # the module's three real audits take about 30 s
def test_compare_shows_the_same_verdict(audits, tmp_path, capsys):
    root, _ = audits
    code, out, _ = run_cli(
        ["compare", root / "base" / "report.json", root / "leaky" / "report.json", "--out", tmp_path], capsys
    )
    assert code == 0 and "regression test: REGRESSION beyond noise: bound, kmeans" in out
    assert "REGRESSED" in (tmp_path / "comparison.md").read_text()
    code, out, _ = run_cli(
        ["compare", root / "base" / "report.json", root / "same" / "report.json", "--out", tmp_path], capsys
    )
    assert "no regression beyond noise" in out


@pytest.mark.slow  # the module's three real audits take about 30 s
def test_a_baseline_that_is_not_a_report_is_bad_input(audits, tmp_path, capsys):
    root, _ = audits
    code, _, err = run_cli(["run", MODEL, *QUICK, "--baseline", tmp_path / "none.json"], capsys)
    assert code == 2 and "not found" in err
    (tmp_path / "sweep.json").write_text('{"schema_version": 6, "kind": "sweep"}')
    code, _, err = run_cli(["run", MODEL, *QUICK, "--baseline", tmp_path / "sweep.json"], capsys)
    assert code == 2 and "Traceback" not in err
