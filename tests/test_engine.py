"""The audit engine (pipeline.AuditEngine): one prepared context, one measurement, one audit point
per sigma. run = one point + gate, sweep = many points + recommendation, calibrate = the
measurement alone: each of them must measure once and agree with the others on the same inputs."""

from __future__ import annotations

import pytest
from conftest import sample

from splitaudit.core.config import AuditOptions
from splitaudit.engine import pipeline
from splitaudit.engine.pipeline import AuditEngine, run_audit, run_calibration
from splitaudit.stages import leakage

OPTIONS = dict(
    model=sample("breast_cancer_mlp.onnx"), aux=sample("breast_cancer.npz"), prior="gaussian", quick=True, seed=3
)


@pytest.fixture
def measurements(monkeypatch) -> list:
    """Every measurement taken (the traces and the prior: the slow part), in order."""
    taken, measure = [], leakage.measure

    def counted(*args, **kwargs):
        taken.append(measure(*args, **kwargs))
        return taken[-1]

    monkeypatch.setattr(leakage, "measure", counted)
    return taken


def test_points_at_several_sigmas_share_one_measurement(measurements):
    """dFIL scales as 1/sigma^2 from the one measurement, so the bound at 2 sigma is (almost,
    through the prior term) what 1/(dFIL/4 + J/d) gives; a point asked twice is the same point."""
    options = AuditOptions(**OPTIONS, attacks=["none"]).validate()
    with AuditEngine.prepared(options) as engine:
        one, two = engine.point(0.5, {}), engine.point(1.0, {})
        again = engine.point(0.5, {})
    assert len(measurements) == 1
    assert one == again
    j = one["prior"]["J_over_d_used"]
    dfil_one, dfil_two = one["bounds"]["dfil_used"], two["bounds"]["dfil_used"]
    assert dfil_two == pytest.approx(dfil_one / 4, rel=1e-9)
    assert two["bounds"]["van_trees_mse"] == pytest.approx(1 / (dfil_two + j), rel=1e-12)
    assert one["noise_sigma"] == 0.5 and two["utility"]["clean_accuracy"] == one["utility"]["clean_accuracy"]


def test_run_is_one_engine_point_and_calibrate_its_measurement(measurements):
    """run_audit's sections are the engine's point at --noise-sigma; calibrate, on the same inputs,
    measures the same traces and prior and finds the sigma the run's calibration section found."""
    options = AuditOptions(**OPTIONS, attacks=["kmeans"], noise_sigma=0.5).validate()
    result = run_audit(options)
    target = result["calibration"]["target_mse"]  # the default: half the mean-guess MSE
    with AuditEngine.prepared(AuditOptions(**OPTIONS, attacks=["none"]).validate(), attacks=False) as engine:
        point = engine.point(0.5, {})
    for section in ("dfil", "prior", "calibration"):
        assert result[section] == point[section], section
    assert result["bounds"]["van_trees_mse"] == point["bounds"]["van_trees_mse"]
    assert result["gate"]["checks"] and result["attacks"]["kmeans"]["status"] == "ok"
    answer = run_calibration(AuditOptions(**OPTIONS, attacks=["none"], target_mse=target).validate())
    assert len(measurements) == 3  # one per entry point, none twice
    assert answer["feasible"] and answer["sigma"] == result["calibration"]["sigma"] > 0


def test_calibrate_opens_no_executor(monkeypatch):
    monkeypatch.setattr(pipeline, "open_executor", lambda *a, **k: pytest.fail("calibrate opened an executor"))
    answer = run_calibration(AuditOptions(**OPTIONS, attacks=["none"], target_mse=1e-3).validate())
    assert answer["target_mse"] == 1e-3 and "sigma" in answer
