"""`splitaudit sweep`: the closed-form bound of a linear encoder at every sigma, the frontier on the
bundled models (bound and attack MSEs rise, utility falls), utility against the model's clean
accuracy, the recommendation and its gates, the reports and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import sample

from splitaudit.cli import main
from splitaudit.core.config import AuditOptions
from splitaudit.core.result import SCHEMA_VERSION, first_error, sweep_json_schema
from splitaudit.engine.pipeline import prepare_context
from splitaudit.engine.sweep import AUTO_FACTORS, run_sweep, sweep_sigmas
from splitaudit.reports import load_result
from splitaudit.reports.files import to_strict_json
from splitaudit.reports.sweep import build_sweep_view, sweep_summary
from splitaudit.stages import leakage
from splitaudit.verdicts.recommend import recommend

DIGITS = dict(model=sample("digits_cnn.onnx"), aux=sample("digits.npz"))
real_measure = leakage.measure


def cli(args) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code


# --- the analytic case: a linear encoder and Gaussian data -----------------------------------------


@pytest.fixture(scope="module")
def linear_case(tmp_path_factory):
    """z = A x with x ~ N(0, s^2 I): dFIL = ||A||_F^2 / (d sigma^2) exactly, and the Gaussian prior's
    J/d = 1/s^2, so van Trees = 1 / (||A||_F^2/(d sigma^2) + 1/s^2) at every sigma."""
    folder = tmp_path_factory.mktemp("linear")
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(4, 6, generator=generator)
    encoder = torch.nn.Linear(6, 4, bias=False)
    encoder.weight.data = a
    torch.jit.trace(encoder, torch.zeros(1, 6)).save(str(folder / "linear.pt"))
    s = 0.5
    x = (s * torch.randn(2000, 6, generator=generator)).numpy()
    np.savez(folder / "gauss.npz", x=x)
    return str(folder / "linear.pt"), str(folder / "gauss.npz"), float(a.pow(2).sum()), s


def test_a_linear_encoder_has_the_closed_form_bound_at_every_sigma(linear_case, monkeypatch):
    model, data, a_norm_sq, s = linear_case
    measured = []
    monkeypatch.setattr(leakage, "measure", lambda *args, **kw: measured.append(1) or real_measure(*args, **kw))
    options = AuditOptions(
        model=model, aux=data, noise_sigmas=[0.1, 0.3, 1.0, 3.0], prior="gaussian", attacks=["none"], quick=True
    ).validate()
    sweep = run_sweep(options)
    assert measured == [1]  # traces and prior computed once for the four sigmas
    aux = prepare_context(options).aux.x.double()
    variance = float(aux.var(dim=0).mean())  # unbiased per-dimension variance, averaged
    d = 6
    assert variance == pytest.approx(s**2, rel=0.1)
    assert sweep["prior"]["smoothing"] == 0.0
    for point, sigma in zip(sweep["points"], [0.1, 0.3, 1.0, 3.0]):
        dfil = a_norm_sq / (d * sigma**2)
        assert point["noise_sigma"] == sigma
        assert point["dfil"]["mean"] == pytest.approx(dfil, rel=1e-5)
        assert point["bounds"]["cramer_rao_mse"] == pytest.approx(1 / dfil, rel=1e-5)
        assert point["bounds"]["van_trees_mse"] == pytest.approx(1 / (dfil + 1 / variance), rel=1e-5)
        assert point["utility"]["status"] == "skipped" and "no labels" in point["utility"]["reason"]
    again = run_sweep(options)  # a second call gives the same points
    assert [p["bounds"] for p in again["points"]] == [p["bounds"] for p in sweep["points"]]


def test_a_point_context_has_its_own_sigma_and_shares_the_clean_embeddings(digits_ctx):
    point_ctx = digits_ctx.at_sigma(0.3, seed=5)
    assert (point_ctx.noise_sigma, point_ctx.seed) == (0.3, 5) and digits_ctx.noise_sigma == 0
    assert point_ctx.clean_embeddings("target") is digits_ctx.clean_embeddings("target")
    observed = point_ctx.observed_embeddings("target", point_ctx.generator(0))
    noise_std = float((observed - digits_ctx.clean_embeddings("target")).std())
    assert noise_std == pytest.approx(0.3, rel=0.02)


# --- the recommendation on synthetic points --------------------------------------------------------


def point(sigma: float, bound: float, violated=(), loss=0.0) -> dict:
    return {
        "noise_sigma": sigma,
        "bounds": {"van_trees_mse": bound, "violated_by": list(violated)},
        "attacks": {"decoder": {"kind": "reconstruction", "status": "ok"}},
        "utility": {"status": "ok", "loss": loss, "accuracy": 0.9 - loss, "clean_accuracy": 0.9},
    }


def test_recommendation_is_the_smallest_sigma_reaching_the_target_that_no_attack_beats():
    points = [
        point(0.0, 0.0),
        point(0.5, 0.02),
        point(1.0, 0.05, violated=["decoder"]),
        point(2.0, 0.08, loss=0.03),
        point(4.0, 0.1, loss=0.2),
    ]
    rec = recommend(points, target_mse=0.04)
    assert rec["noise_sigma"] == 2.0 and rec["point_index"] == 3
    assert rec["van_trees_mse"] == 0.08 and rec["utility_loss"] == 0.03 and rec["meets_utility"] is None
    assert "checked by decoder" in rec["reason"]
    assert recommend(points, 0.04, max_utility_loss=0.05)["meets_utility"] is True
    strict = recommend(points, 0.04, max_utility_loss=0.01)
    assert strict["noise_sigma"] == 2.0 and strict["meets_utility"] is False
    assert "MORE than the allowed utility loss 0.01" in strict["reason"]


def test_no_recommendation_says_why():
    beaten = recommend([point(0.1, 0.01), point(1.0, 0.05, violated=["sdar"])], target_mse=0.04)
    assert beaten["noise_sigma"] is None and "beaten by an attack (sigma 1 by sdar)" in beaten["reason"]
    short = recommend([point(0.0, 0.0), point(0.1, 0.01)], target_mse=0.04)
    assert short["noise_sigma"] is None and "largest is 0.01 at sigma 0.1" in short["reason"]


def test_the_calibrated_sigma_counts_as_reaching_its_target_despite_rounding():
    assert recommend([point(0.7, 0.04 * (1 - 1e-12))], target_mse=0.04)["noise_sigma"] == 0.7


def test_auto_sigma_adds_the_calibrated_sigma_and_log_spaced_neighbours_once():
    sigmas = sweep_sigmas([0.0, 1.0, 0.5, 0.3], calibrated=0.5)
    assert [s for s, _ in sigmas] == pytest.approx([0.0, 0.25, 0.3, 0.5, 1.0])
    origins = dict((round(s, 9), o) for s, o in sigmas)
    assert origins[0.5] == "calibrated" and origins[0.0] == "grid" and origins[0.25] == "around-calibrated"
    assert origins[1.0] == "grid"  # a grid point the auto points repeat stays one point
    assert sweep_sigmas([0.1], calibrated=None) == [(0.1, "grid")]


# --- the bundled digits CNN ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_sweep():
    """The digits CNN with its top model at sigma 0..3, the fast attacks, quick settings."""
    options = AuditOptions(
        **DIGITS,
        top_model=sample("digits_cnn_top.pt"),
        noise_sigmas=[0, 0.1, 0.3, 1, 3],
        attacks=["kmeans", "optimization"],
        quick=True,
    ).validate()
    return run_sweep(options), options


def series(sweep: dict, get) -> list[float]:
    return [get(p) for p in sweep["points"]]


def test_on_the_digits_cnn_the_bound_rises_and_every_attack_weakens_with_sigma(digits_sweep):
    sweep, _ = digits_sweep
    bounds = series(sweep, lambda p: p["bounds"]["van_trees_mse"])
    assert bounds[0] == 0.0 and all(b < c for b, c in zip(bounds, bounds[1:]))
    guess = sweep["points"][0]["bounds"]["mean_guess_mse"]
    mse = series(sweep, lambda p: p["attacks"]["optimization"]["metrics"]["mse"])
    # The error rises toward guessing the average input (10% slack per step for one quick seed).
    assert all(later >= 0.9 * earlier for earlier, later in zip(mse, mse[1:])), mse
    assert mse[-1] > 5 * mse[0] and mse[-1] < guess
    advantage = series(sweep, lambda p: p["attacks"]["kmeans"]["advantage"])
    assert advantage[-1] < advantage[0] - 0.05, advantage


@pytest.mark.slow
@pytest.mark.parametrize("stem", ["digits_cnn"])  # quick SDAR on digits_mlp is noise-dominated (below)
def test_every_reconstruction_attack_weakens_toward_the_mean_guess(stem):
    options = AuditOptions(
        model=sample(f"{stem}.onnx"),
        aux=sample("digits.npz"),
        top_model=sample(f"{stem}_top.pt"),
        noise_sigmas=[0, 0.3, 3],
        attacks=["decoder", "optimization", "sdar"],
        quick=True,
    ).validate()
    sweep = run_sweep(options)
    bounds = series(sweep, lambda p: p["bounds"]["van_trees_mse"])
    assert bounds[0] == 0.0 < bounds[1] < bounds[2]
    guess = sweep["points"][0]["bounds"]["mean_guess_mse"]
    for name in ("decoder", "optimization", "sdar"):
        mse = series(sweep, lambda p: p["attacks"][name]["metrics"]["mse"])
        assert mse[0] < mse[2] < 1.05 * guess, (name, mse)
        # Between the end points only where the error is set by the noise: quick SDAR (one seed, few
        # iterations) varies by ~10% between runs (measured 0.043 at sigma 0, 0.038 at 0.3), and the
        # MLP's 32-dimensional embedding of 64 inputs is not invertible, so at small sigma the
        # optimisation's error is the optimiser's (measured 0.048 at sigma 0, 0.038 at 0.3); there quick
        # SDAR measured 0.052, 0.045, 0.048 at sigma 0, 0.3, 3: no trend to test at that training budget.
        if stem == "digits_cnn" and name != "sdar":
            assert mse[1] >= 0.9 * mse[0], (name, mse)
    accuracy = series(sweep, lambda p: p["utility"]["accuracy"])
    assert accuracy[2] < accuracy[0] - 0.1


def test_on_the_digits_cnn_utility_falls_with_sigma(digits_sweep):
    sweep, _ = digits_sweep
    accuracy = series(sweep, lambda p: p["utility"]["accuracy"])
    assert all(later <= earlier + 0.01 for earlier, later in zip(accuracy, accuracy[1:])), accuracy
    assert accuracy[-1] < accuracy[0] - 0.2
    assert sweep["points"][0]["utility"]["loss"] == 0.0
    assert all(p["utility"]["source"] == "top-model" for p in sweep["points"])


def test_utility_at_sigma_zero_is_the_split_models_clean_accuracy(digits_sweep):
    sweep, options = digits_sweep
    target = prepare_context(options).target
    bottom = torch.jit.load(sample("digits_cnn.pt"), map_location=target.x.device)  # TorchScript twin of the ONNX
    top = torch.jit.load(sample("digits_cnn_top.pt"), map_location=target.x.device)
    with torch.no_grad():
        clean = float((top(bottom(target.x)).argmax(1) == target.y).double().mean())
    assert clean > 0.95
    # ONNX conversion may flip at most one borderline sample.
    assert sweep["points"][0]["utility"]["accuracy"] == pytest.approx(clean, abs=1.01 / len(target))
    assert sweep["utility_clean"]["accuracy"] == sweep["points"][0]["utility"]["accuracy"]


def test_the_recommended_point_is_not_beaten_or_the_violations_are_flagged(digits_sweep):
    sweep, _ = digits_sweep
    rec = sweep["recommendation"]
    for p in sweep["points"]:
        check = p["attacks"]["optimization"].get("bound_check")
        assert check is not None and check["violated"] == ("optimization" in p["bounds"]["violated_by"])
    if rec["noise_sigma"] is None:
        assert "beaten" in rec["reason"] or "no audited sigma" in rec["reason"]
    else:
        chosen = sweep["points"][rec["point_index"]]
        assert chosen["noise_sigma"] == rec["noise_sigma"] and not chosen["bounds"]["violated_by"]
        assert chosen["bounds"]["van_trees_mse"] >= sweep["target_mse"] * (1 - 1e-9)
        smaller = [p for p in sweep["points"] if p["noise_sigma"] < rec["noise_sigma"]]
        assert all(p["bounds"]["van_trees_mse"] < sweep["target_mse"] or p["bounds"]["violated_by"] for p in smaller)


def test_sweep_json_has_the_contract_keys_and_renders_from_itself(digits_sweep):
    sweep, _ = digits_sweep
    assert sweep["schema_version"] == SCHEMA_VERSION and sweep["kind"] == "sweep"
    assert sweep["run"]["executor"] == "local"
    assert first_error(to_strict_json(sweep), sweep_json_schema()) is None
    for p in sweep["points"]:
        assert {"noise_sigma", "dfil", "bounds", "attacks", "utility"} <= set(p)
        assert {"accuracy", "source", "loss"} <= set(p["utility"])
    assert {"noise_sigma", "van_trees_mse", "utility_loss", "reason"} <= set(sweep["recommendation"])
    view = build_sweep_view(sweep, with_figures=False)
    assert view.summary[0].label == "Recommendation"
    assert len(view.frontier.rows) == len(view.points) == 5
    text = sweep_summary(sweep)
    assert text.splitlines()[0] == view.headline and "Recommendation:" in text


# --- the command line ------------------------------------------------------------------------------


def test_sweep_cli_writes_the_reports_gates_the_utility_and_renders_again(tmp_path, capsys):
    out = tmp_path / "sweep"
    junit = tmp_path / "gates.xml"
    code = cli(
        [
            "sweep",
            DIGITS["model"],
            "--aux",
            DIGITS["aux"],
            "--noise-sigma",
            "0,0.3",
            "--auto-sigma",
            "--top-model",
            sample("digits_cnn_top.pt"),
            "--target-mse",
            "0.03",
            "--attacks",
            "none",
            "--max-utility-loss",
            "0",
            "--quick",
            "--out",
            str(out),
            "--junit",
            str(junit),
        ]
    )
    stdout = capsys.readouterr().out
    assert code == 1  # the recommended sigma costs accuracy, and none is allowed
    assert {p.name for p in out.iterdir()} >= {"sweep.json", "sweep.html", "sweep.md"}
    sweep = json.loads((out / "sweep.json").read_text())  # strict JSON
    rec = sweep["recommendation"]
    calibrated = [p for p in sweep["points"] if p["origin"] == "calibrated"]
    assert len(calibrated) == 1 and rec["noise_sigma"] == calibrated[0]["noise_sigma"]
    assert calibrated[0]["bounds"]["van_trees_mse"] == pytest.approx(0.03, rel=1e-6)
    assert len(sweep["points"]) == 2 + len(AUTO_FACTORS)
    assert rec["utility_loss"] > 0 and rec["meets_utility"] is False
    assert "max-utility-loss" in junit.read_text() and "FAILED" in stdout
    html = (out / "sweep.html").read_text()
    assert html.index("Recommendation") < html.index("privacy-utility frontier") and "data:image/png;base64," in html
    (out / "sweep.html").unlink()
    assert cli(["render", str(out / "sweep.json"), "--format", "html"]) == 0
    assert (out / "sweep.html").read_text() == html
    assert load_result(out / "sweep.json")["kind"] == "sweep"
    sweep["recommendation"]["noise_sigma"] = "a lot"
    (out / "broken.json").write_text(json.dumps(sweep))
    assert cli(["render", str(out / "broken.json")]) == 2
    assert "/recommendation/noise_sigma: expected number" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ["--noise-sigma", "0,-1"],
            "--noise-sigma must be a list of numbers, each 0 or >= 1e-12 and <= 1e+12, got -1.0",
        ),
        ([], "no noise sigmas to sweep"),
        (["--noise-sigma", "0,x"], "comma-separated list"),
        (["--noise-sigma", "1", "--target-mse", "0"], "--target-mse must be a number > 0 and <= 1e+12, got 0.0"),
        (["--noise-sigma", "1", "--max-utility-loss", "2"], "--max-utility-loss"),
        (
            ["--noise-sigma", "1", "--format", "html,sarif"],
            "--format takes a comma list of html, md, json, junit for a sweep",
        ),
    ],
)
def test_sweep_bad_input_is_one_line_and_exit_2(args, fragment, capsys):
    code = cli(["sweep", DIGITS["model"], "--aux", DIGITS["aux"], "--attacks", "none", "--quick", *args])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err and "Traceback" not in err


def test_run_reports_utility_at_its_sigma_with_a_probe_without_a_top_model(tmp_path):
    out = tmp_path / "r"
    code = cli(
        [
            "run",
            sample("breast_cancer_mlp.onnx"),
            "--aux",
            sample("breast_cancer.npz"),
            "--attacks",
            "none",
            "--noise-sigma",
            "3",
            "--quick",
            "--out",
            str(out),
            "--format",
            "json,md",
        ]
    )
    assert code == 0
    utility = load_result(out / "report.json")["utility"]
    assert utility["source"] == "probe" and utility["noise_sigma"] == 3
    assert 0.5 < utility["accuracy"] < utility["clean_accuracy"]
    assert utility["loss"] == pytest.approx(utility["clean_accuracy"] - utility["accuracy"])
    assert "Utility:" in (out / "report.md").read_text()


@pytest.mark.slow
def test_demo_sweep_quick_audits_the_calibrated_sigma(tmp_path):
    out = tmp_path / "demo"
    assert cli(["demo", "--sweep", "--quick", "--out", str(out)]) == 0
    sweep = load_result(out / "sweep.json")
    assert sweep["auto_sigma"]["sigma"] in [p["noise_sigma"] for p in sweep["points"]]
    statuses = [(n, a["status"]) for p in sweep["points"] for n, a in p["attacks"].items()]
    token_only = {"token-inversion", "sequential-inversion"}  # they need --vocab
    assert all(status == "ok" for name, status in statuses if name not in token_only)
    assert all(status == "skipped" for name, status in statuses if name in token_only)
    assert (out / "sweep.html").exists() and (out / "sweep.md").exists()


def test_the_demo_sweep_leaves_out_only_the_attacks_that_train_for_minutes_at_each_point():
    """By their declared relative cost, not by name: SDAR today."""
    from splitaudit.attacks import attack_names
    from splitaudit.engine.sweep import demo_sweep_options

    options = demo_sweep_options(AuditOptions(model=sample("digits_cnn.onnx"), aux=sample("digits.npz")))
    assert set(attack_names()) - set(options.attacks) == {"sdar"}
