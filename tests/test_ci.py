"""The CI integrations run locally with the variables those systems set: the GitHub Action's audit step
(action.yml's own script, with a temporary GITHUB_STEP_SUMMARY and GITHUB_OUTPUT), the GitLab job
(GITLAB_CI: JUnit and a dotenv report), and the pre-commit hook against a report's provenance."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from conftest import sample

from splitaudit.ci import pre_commit
from splitaudit.core.version import __version__

ROOT = Path(__file__).resolve().parents[1]
MODEL, DATA = sample("digits_cnn.onnx"), sample("digits.npz")
QUICK = f"{MODEL} --aux {DATA} --attacks none --quick --prior gaussian --dfil-samples 64 --noise-sigma 0.5"


def read_outputs(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def ci_environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment without the CI variables of whatever runs the tests, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "GITLAB_", "CI"))}
    return {**env, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


@pytest.fixture(scope="module")
def action():
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / "action.yml").read_text())


@pytest.mark.slow  # a real audit in a subprocess (about 20 s)
def test_the_action_audit_step_fills_the_job_summary_and_outputs_and_fails_on_the_gate(action, tmp_path):
    step = next(s for s in action["runs"]["steps"] if s.get("id") == "audit")
    summary, outputs = tmp_path / "summary.md", tmp_path / "outputs"
    step_env = {k: v.replace("${{ inputs.args }}", f"{QUICK} --fail-under-mse 0.5") for k, v in step["env"].items()}
    env = ci_environment(
        tmp_path, GITHUB_ACTIONS="true", GITHUB_STEP_SUMMARY=str(summary), GITHUB_OUTPUT=str(outputs), **step_env
    )
    done = subprocess.run([step["shell"], "-c", step["run"]], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 1, done.stderr  # the bound 0.02 is below 0.5: the job fails on the gate
    values = read_outputs(outputs)
    assert values["exit-code"] == "1" and values["passed"] == "false"
    report = json.loads((tmp_path / values["report-dir"] / "report.json").read_text())
    assert values["fingerprint"] == report["provenance"]["fingerprint"]
    assert json.loads((tmp_path / values["sarif"]).read_text())["version"] == "2.1.0"
    assert summary.read_text().startswith("# ❌ FAILED: the provable bound is too low")
    # every output the later steps (artifact, SARIF upload) and the action's outputs read is written
    referenced = set(re.findall(r"steps\.audit\.outputs\.([\w-]+)", (ROOT / "action.yml").read_text()))
    assert referenced <= set(values)


def test_the_action_says_why_when_splitaudit_could_not_audit(tmp_path, monkeypatch):
    from splitaudit import ci

    summary, outputs = tmp_path / "summary.md", tmp_path / "outputs"
    env = ci_environment(tmp_path, GITHUB_ACTIONS="true", GITHUB_STEP_SUMMARY=str(summary), GITHUB_OUTPUT=str(outputs))
    monkeypatch.chdir(tmp_path)
    code = ci.audit_step(["missing.onnx", "--aux", DATA], env)
    assert code == 2 and read_outputs(outputs)["passed"] == "false"
    assert "could not audit (exit 2)" in summary.read_text() and "model file not found" in summary.read_text()


@pytest.mark.slow  # a real audit in a subprocess (about 20 s)
def test_the_gitlab_job_writes_junit_and_a_dotenv_report(tmp_path):
    env = ci_environment(tmp_path, GITLAB_CI="true", SPLITAUDIT_ARGS=f"{QUICK} --out gitlab-report")
    done = subprocess.run([sys.executable, "-m", "splitaudit.ci", "run"], cwd=tmp_path, env=env, capture_output=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "gitlab-report" / "report.junit.xml").is_file()
    values = read_outputs(tmp_path / "splitaudit.env")
    assert values["SPLITAUDIT_EXIT_CODE"] == "0" and values["SPLITAUDIT_REPORT_DIR"] == "gitlab-report"
    assert len(values["SPLITAUDIT_FINGERPRINT"]) == 12


def test_the_pre_commit_hook_passes_audited_models_and_stops_changed_or_unaudited_ones(tmp_path, capsys):
    from splitaudit.core.config import AuditOptions
    from splitaudit.engine.provenance import provenance_section
    from splitaudit.inputs.digests import digest_record

    shutil.copy(MODEL, tmp_path / "bottom.onnx")
    files = [digest_record("model", tmp_path / "bottom.onnx"), digest_record("aux", Path(DATA))]
    options = AuditOptions(model=str(tmp_path / "bottom.onnx"), aux=DATA)
    report = json.loads((ROOT / "tests" / "fixtures" / "image_audit.json").read_text())
    started = datetime.now(timezone.utc)
    report["tool"]["version"] = __version__  # the fingerprint covers the version that wrote the report
    report["provenance"] = provenance_section(options, files, torch.device("cpu"), [0], None, None, started)
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert pre_commit([str(tmp_path / "bottom.onnx")], [str(tmp_path / "report.json")]) == 0
    with open(tmp_path / "bottom.onnx", "ab") as stream:
        stream.write(b"\0")
    shutil.copy(MODEL, tmp_path / "other.onnx")
    assert (
        pre_commit([str(tmp_path / "bottom.onnx"), str(tmp_path / "other.onnx")], [str(tmp_path / "report.json")]) == 1
    )
    err = capsys.readouterr().err
    assert "bottom.onnx: changed since its audit" in err and "other.onnx: no audit records it" in err
