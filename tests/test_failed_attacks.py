"""An attack that fails is never evidence of privacy (issues 23 and 25): an attack that did worse
than its baseline, or whose own training signal did not improve, is reported as FAILED in
report.json, the verdict, the gate and every rendered output; quick runs say that their attacks
only bound the leakage from below; a seed spread as wide as the distance to the baseline is shown."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from splitaudit.attacks import get_attack
from splitaudit.attacks.base import SeedOutcome
from splitaudit.attacks.sdar_training import FULL, SDARNets
from splitaudit.gate import evaluate_gate
from splitaudit.reports.terminal import terminal_summary
from splitaudit.reports.view import build_view


def outcome(mse: float, baseline: float = 0.073, not_converged: str = "") -> SeedOutcome:
    return SeedOutcome(metrics={"mse": mse}, baseline={"mse": baseline}, not_converged=not_converged)


def result_with(entry: dict, quick: bool = False) -> dict:
    """The sections the gate and the renderers read, around one attack entry."""
    result = {"attacks": {"sdar": entry}, "run": {"quick": quick}, "noise_sigma": 0.0}
    result["gate"] = evaluate_gate(result)
    return result


@pytest.fixture(scope="module")
def untrained_sdar(digits_ctx):
    """Real SDAR on the digits CNN with neither g nor labels, stopped after 20 iterations: its
    decoder has not learned yet, so it reconstructs worse than the mean guess (0.073)."""
    ctx = dataclasses.replace(digits_ctx, attack_options={"sdar": {"labels": "inferred", "iterations": 20}})
    return get_attack("sdar").run(ctx)


def test_an_attack_worse_than_its_baseline_failed_to_train(untrained_sdar):
    entry = untrained_sdar
    assert entry["status"] == "ok"
    assert entry["metrics"]["mse"] > entry["baseline"]["mse"] and entry["advantage"] < 0
    assert entry["failed_to_train"].startswith("it did worse than its baseline (mse ")
    gate = evaluate_gate({"attacks": {"sdar": entry}})
    assert not gate["passed"]
    check = gate["checks"][0]
    assert check["cause"] == "attack-failed-to-train" and check["severity"] == "error"
    assert "sdar (it did worse than its baseline" in check["message"] and "not evidence of privacy" in check["message"]


def test_the_verdict_and_every_output_say_the_attack_failed(untrained_sdar):
    result = result_with(untrained_sdar)
    view = build_view(result, with_figures=False)
    assert view.headline == "FAILED: an attack FAILED to train (its result is not evidence of privacy)"
    assert any(a.startswith("ATTACK FAILED: sdar failed to train") for a in view.alerts)
    strongest = next(item for item in view.summary if item.label == "Strongest attack")
    assert strongest.tone == "bad" and "FAILED to train" in strongest.text  # never "good" (protection)
    assert view.overview.rows[0][1] == "FAILED TO TRAIN" and view.overview.row_classes == ["failed"]
    attack = view.attacks[0]
    assert attack.untrained and attack.advantage.startswith("The attack FAILED to train")
    text = terminal_summary(result)
    assert text.splitlines()[0].startswith("FAILED: an attack FAILED to train") and "FAILED TO TRAIN" in text


def test_a_trained_attack_is_not_flagged_and_a_failed_one_is_not_counted_as_protection():
    sdar = get_attack("sdar")
    good = sdar.summarize([0, 1], [outcome(0.020), outcome(0.024)], 1.0)
    assert "failed_to_train" not in good and "spread_warning" not in good
    assert evaluate_gate({"attacks": {"sdar": good}})["passed"]
    bad = sdar.summarize([0], [outcome(0.080)], 1.0)
    decoder = {**good, "title": get_attack("decoder").title}  # the report names an attack by its entry's title
    result = {"attacks": {"sdar": bad, "decoder": decoder}, "run": {"quick": False}}
    result["gate"] = evaluate_gate(result)
    strongest = next(
        item for item in build_view(result, with_figures=False).summary if item.label == "Strongest attack"
    )
    assert strongest.text.startswith("Decoder") or "decoder" in strongest.text.lower()
    assert "removes 70% of the error" in strongest.text  # the decoder's 0.022 against 0.073, not sdar's


def test_a_stalled_training_signal_fails_the_attack_even_when_it_beats_the_baseline():
    entry = get_attack("sdar").summarize([0, 1], [outcome(0.05), outcome(0.05, not_converged="loss flat")], 1.0)
    assert entry["advantage"] > 0 and entry["failed_to_train"] == "seed 1: loss flat"
    assert not evaluate_gate({"attacks": {"sdar": entry}})["passed"]


def test_sdar_notices_when_its_simulator_loss_does_not_fall(digits_ctx):
    nets = SDARNets.build(digits_ctx, 0, FULL)
    nets.task_losses = [torch.tensor(2.3)] * 10
    assert nets.stalled() == ""  # too few iterations to tell
    nets.task_losses = [torch.tensor(2.3 - 0.01 * i) for i in range(40)]
    assert nets.stalled() == ""
    nets.task_losses = [torch.tensor(2.0 + 0.01 * i) for i in range(40)]
    assert nets.stalled().startswith("its own training signal did not improve (the simulator's classification")
    assert "2.02 over the first 4 iterations, 2.38 over the last 4" in nets.stalled()


def test_u_shaped_label_inference_at_the_majority_baseline_fails_sdar():
    labelled = SeedOutcome(
        metrics={"mse": 0.03, "label_accuracy": 0.09, "label_accuracy_relabelled": 0.5},
        baseline={"mse": 0.073, "label_accuracy": 0.092, "label_accuracy_relabelled": 0.109},
    )
    entry = get_attack("sdar").summarize([0], [labelled], 1.0)
    assert entry["advantage"] > 0
    assert entry["failed_to_train"].startswith(
        "its label inference did no better than the majority class (label accuracy 0.09 against 0.092); "
        "why: the classes were separated (0.5 under the best renaming) but named wrongly (0.09)"
    )
    labelled.metrics["label_accuracy"] = 0.5
    assert "failed_to_train" not in get_attack("sdar").summarize([0], [labelled], 1.0)


def test_a_seed_spread_as_wide_as_the_distance_to_the_baseline_is_shown():
    """Issue 25: MSE 0.114 ± 0.072 against a mean guess of 0.073 (here 0.042 and 0.186 on two seeds)."""
    entry = get_attack("sdar").summarize([0, 1], [outcome(0.042), outcome(0.186)], 1.0)
    assert entry["advantage_std"] >= abs(entry["advantage"])
    assert entry["spread_warning"].startswith("the spread between seeds (advantage")
    view = build_view(result_with(entry), with_figures=False)
    assert any(a.startswith("sdar: the spread between seeds") for a in view.alerts)
    narrow = get_attack("sdar").summarize([0, 1], [outcome(0.030), outcome(0.032)], 1.0)
    assert "spread_warning" not in narrow


def test_quick_results_are_labelled_as_lower_bounds_everywhere():
    entry = get_attack("sdar").summarize([0], [outcome(0.02)], 1.0)
    quick, full = result_with(entry, quick=True), result_with(entry, quick=False)
    assert build_view(quick, with_figures=False).headline.endswith("[QUICK RUN: lower bounds on leakage]")
    assert not build_view(full, with_figures=False).headline.endswith("]")
    assert any("lower bound on the leakage" in a for a in build_view(quick, with_figures=False).alerts)
    assert "[QUICK RUN" in terminal_summary(quick).splitlines()[0]


def test_report_files_mark_the_failed_attack_and_the_quick_run(untrained_sdar, tmp_path):
    """html, md and report.json (checked against the shipped schema as it is written) of a real
    audit's result with the untrained SDAR entry in it."""
    from pathlib import Path

    from splitaudit.reports import load_result
    from splitaudit.reports.writer import write_reports

    result = load_result(Path(__file__).parent / "fixtures" / "image_audit.json")
    result["attacks"]["sdar"] = untrained_sdar
    result["run"]["quick"] = True
    result["gate"] = evaluate_gate(result)
    write_reports(result, tmp_path, ["html", "md", "json"])
    html, md = (tmp_path / "report.html").read_text(), (tmp_path / "report.md").read_text()
    for page in (html, md):
        assert "FAILED: an attack FAILED to train" in page and "QUICK RUN: lower bounds on leakage" in page
        assert "ATTACK FAILED: sdar failed to train" in page and "FAILED TO TRAIN" in page
    assert '<span class="badge failed">FAILED to train</span>' in html and "❌ FAILED to train" in md
    written = load_result(tmp_path / "report.json")
    assert written["attacks"]["sdar"]["failed_to_train"] == untrained_sdar["failed_to_train"]
    assert written["gate"]["checks"][0]["cause"] == "attack-failed-to-train"
