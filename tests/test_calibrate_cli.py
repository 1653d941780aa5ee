"""`splitaudit calibrate` through the command line on the sample models."""

from __future__ import annotations

import json

import pytest
from conftest import sample

from splitaudit.cli import main
from splitaudit.stages import calibration


def cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as stop:
        main(args)
    out = capsys.readouterr()
    return stop.value.code, out.out, out.err


def calibrate_args(model: str, data: str, target: str, *extra: str) -> list[str]:
    return ["calibrate", sample(model), "--aux", sample(data), "--target-mse", target, "--quick", *extra]


def test_calibrate_json_matches_the_library_answer(capsys, digits_ctx):
    code, out, _ = cli(calibrate_args("digits_cnn.onnx", "digits.npz", "0.03", "--json"), capsys)
    answer = json.loads(out)
    assert code == 0
    assert answer["bound"] == "van-trees" and answer["target_mse"] == 0.03 and answer["feasible"]
    assert 0 < answer["sigma_unbiased"] < answer["sigma"]
    assert answer["smoothing"] == 0.25 and answer["prior"]["method"] == "ssm"
    # Bit-identical on CPU; CUDA's non-deterministic kernels move the trained prior by ~1e-5 (seen on an H100).
    rel = 1e-4 if digits_ctx.device.type == "cuda" else 1e-6
    assert answer["sigma"] == pytest.approx(calibration.calibrate(digits_ctx, 0.03)["sigma"], rel=rel)


def test_calibrate_prints_one_or_two_lines_for_people(capsys):
    code, out, _ = cli(
        calibrate_args("breast_cancer_mlp.onnx", "breast_cancer.npz", "0.005", "--prior", "gaussian"), capsys
    )
    assert code == 0
    lines = out.strip().splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("noise sigma ")


def test_calibrate_json_reports_an_unreachable_target(capsys):
    code, out, _ = cli(calibrate_args("digits_cnn.pt", "digits.npz", "0.5", "--prior", "gaussian", "--json"), capsys)
    answer = json.loads(out)
    assert code == 0
    assert answer["feasible"] is False and answer["sigma"] is None and "prior alone" in answer["reason"]


def test_calibrate_rejects_a_non_positive_target(capsys):
    code, _, err = cli(calibrate_args("digits_cnn.onnx", "digits.npz", "0", "--json"), capsys)
    assert code == 2 and "--target-mse must be a number > 0" in err and "Traceback" not in err
