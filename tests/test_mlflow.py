"""--mlflow / --mlflow-uri: a real quick audit logged as an MLflow run in a local file store, its
metrics equal to report.json's numbers, its params the options, its artifacts the reports."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import sample

from splitaudit.cli import main

mlflow = pytest.importorskip("mlflow")

MODEL, DATA = sample("digits_cnn.onnx"), sample("digits.npz")
QUICK = ["--aux", DATA, "--attacks", "kmeans", "--quick", "--prior", "gaussian", "--dfil-samples", "64"]


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_an_audit_is_logged_as_one_run_in_a_local_store(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    store = (tmp_path / "mlruns").as_uri()
    args = ["run", MODEL, *QUICK, "--noise-sigma", "0.5", "--out", tmp_path / "out", "--mlflow-uri", store]
    code, out, _ = run_cli(args, capsys)
    assert code == 0 and "logged to MLflow run" in out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    mlflow.set_tracking_uri(store)
    [run] = mlflow.search_runs(experiment_names=["Default"], output_format="list")
    assert run.data.metrics["van_trees_mse"] == report["bounds"]["van_trees_mse"]
    assert run.data.metrics["kmeans.advantage"] == report["attacks"]["kmeans"]["advantage"]
    assert run.data.metrics["gate_passed"] == 1.0 and run.data.params["noise_sigma"] == "0.5"
    assert run.data.tags["splitaudit.fingerprint"] == report["provenance"]["fingerprint"]
    artifacts = {a.path for a in mlflow.artifacts.list_artifacts(run_id=run.info.run_id)}
    assert {"report.json", "report.html", "report.md"} <= artifacts


def test_an_unusable_store_or_missing_mlflow_is_bad_input_before_any_computation(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    args = ["run", MODEL, *QUICK, "--out", tmp_path / "out", "--mlflow-uri", "unknown-scheme://nowhere"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "--mlflow: the tracking store" in err and not (tmp_path / "out" / "report.json").exists()
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if it were not installed
    code, _, err = run_cli(["run", MODEL, *QUICK, "--out", tmp_path / "out", "--mlflow"], capsys)
    assert code == 2 and 'pip install "splitaudit[mlflow]"' in err
