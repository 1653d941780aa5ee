"""Whole audits through the CLI, as a user runs them."""

from __future__ import annotations

import json

import pytest
from conftest import sample

from splitaudit.cli import main
from splitaudit.core.result import SCHEMA_VERSION
from splitaudit.reports import load_result

MODELS = [
    ("digits_cnn", "digits.npz"),
    ("digits_cnn_peloss", "digits.npz"),
    ("digits_mlp", "digits.npz"),
    ("breast_cancer_mlp", "breast_cancer.npz"),
]


def cli(args) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code


@pytest.mark.slow
def test_demo_writes_a_complete_report(tmp_path):
    out = tmp_path / "demo"
    assert cli(["demo", "--quick", "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} >= {"report.json", "report.html", "report.md"}
    result = json.loads((out / "report.json").read_text())  # strict JSON, any parser reads it
    assert result["schema_version"] == SCHEMA_VERSION and result["run"]["quick"] is True
    assert result["model"]["format"] == "onnx" and result["model"]["gradient_mode"] == "autograd"
    attacks = dict(result["attacks"])
    for name in ("token-inversion", "sequential-inversion"):
        assert attacks.pop(name)["status"] == "skipped"  # they need token inputs (--vocab)
    assert all(a["status"] == "ok" for a in attacks.values()), {n: a.get("reason") for n, a in attacks.items()}
    assert result["gate"]["passed"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["onnx", "pt"])
@pytest.mark.parametrize("stem, data", MODELS)
def test_every_sample_model_is_audited_in_both_formats(tmp_path, stem, data, fmt):
    out = tmp_path / "r"
    code = cli(
        [
            "run",
            sample(f"{stem}.{fmt}"),
            "--aux",
            sample(data),
            "--attacks",
            "none",
            "--quick",
            "--noise-sigma",
            "0.5",
            "--out",
            str(out),
            "--format",
            "json",
        ]
    )
    assert code == 0
    result = load_result(out / "report.json")
    assert result["model"]["format"] == ("onnx" if fmt == "onnx" else "torchscript")
    bound, dfil = result["bounds"]["van_trees_mse"], result["dfil"]["mean"]
    assert 0 < dfil < float("inf")
    # van Trees adds the prior's information to the model's, so it can only lower the bound.
    assert 0 < bound <= 1 / dfil * (1 + 1e-9)
