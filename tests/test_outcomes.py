"""Attack outcomes as the papers define them: an attack that did no
better than a raw-input baseline found *no advantage* (Zheng et al., IJCAI 2024: perfect protection), a
finding; a trained attack that ended worse than what it reaches alone *did not learn* (inconclusive):
it measured nothing and is never evidence of privacy. Thresholds decide the gate. Quick runs say that
their attacks only bound the leakage from below; a seed spread as wide as the distance to the
baseline is shown."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import sample

from splitaudit.attacks import get_attack
from splitaudit.attacks.base import SeedOutcome
from splitaudit.attacks.parts.sdar_training import FULL, SDARNets
from splitaudit.cli import main
from splitaudit.reports.terminal import terminal_summary
from splitaudit.reports.view import build_view
from splitaudit.verdicts.gate import evaluate_gate


def outcome(mse: float, baseline: float = 0.073, not_converged: str = "") -> SeedOutcome:
    return SeedOutcome(metrics={"mse": mse}, baseline={"mse": baseline}, not_converged=not_converged)


def clusters(accuracy: float, raw: float) -> SeedOutcome:
    scores = {"nmi": 0.1, "ari": 0.1}
    return SeedOutcome(metrics={"accuracy": accuracy, **scores}, baseline={"accuracy": raw, **scores})


def result_with(entry: dict, quick: bool = False, **thresholds) -> dict:
    """The sections the gate and the renderers read, around one attack entry."""
    result = {"attacks": {entry_name(entry): entry}, "run": {"quick": quick}, "noise_sigma": 0.0}
    result["gate"] = evaluate_gate(result, **thresholds)
    return result


def entry_name(entry: dict) -> str:
    return "kmeans" if entry["primary_metric"] == "accuracy" else "sdar"


@pytest.fixture(scope="module")
def untrained_sdar(digits_ctx):
    """Real SDAR on the digits CNN with neither g nor labels, stopped after 20 iterations: its
    decoder has not learned yet, so it reconstructs worse than the mean guess (0.073)."""
    ctx = dataclasses.replace(digits_ctx, attack_options={"sdar": {"labels": "inferred", "iterations": 20}})
    return get_attack("sdar").run(ctx)


def test_an_attack_worse_than_the_mean_guess_did_not_learn(untrained_sdar):
    entry = untrained_sdar
    assert entry["status"] == "ok" and entry["baseline_role"] == "floor"
    assert entry["metrics"]["mse"] > entry["baseline"]["mse"] and entry["advantage"] < 0
    assert entry["outcome"] == "inconclusive"
    assert entry["failed_to_train"].startswith("it ended worse than guessing the average input (mse ")


def test_an_attack_that_did_not_learn_fails_only_the_thresholds_resting_on_it(untrained_sdar):
    assert evaluate_gate({"attacks": {"sdar": untrained_sdar}})["passed"]  # no threshold: a finding to read
    for thresholds, check in (
        ({"max_advantage": 0.5}, "max-advantage:sdar"),
        ({"fail_under_attack_mse": 0.001}, "fail-under-attack-mse:sdar"),
        ({"strict": True}, "strict:sdar"),
    ):
        gate = evaluate_gate({"attacks": {"sdar": untrained_sdar}}, **thresholds)
        failed = [c for c in gate["checks"] if not c["passed"]]
        assert [(c["name"], c["cause"], c["severity"]) for c in failed] == [(check, "attack-inconclusive", "error")]
        assert failed[0]["message"].startswith("sdar did not learn (it ended worse than guessing the average input")


def test_the_verdict_and_every_output_list_an_attack_that_did_not_learn(untrained_sdar):
    result = result_with(untrained_sdar)
    view = build_view(result, with_figures=False)
    assert view.headline == (
        "AUDIT COMPLETE: no pass/fail thresholds were set; read the findings below; INCONCLUSIVE: sdar did not learn"
    )
    assert any(a.startswith("INCONCLUSIVE: sdar did not learn (it ended worse than") for a in view.alerts)
    strongest = next(item for item in view.summary if item.label == "Strongest attack")
    assert strongest.tone == "bad" and "measured nothing" in strongest.text  # never "good" (protection)
    assert view.overview.rows[0][1] == "INCONCLUSIVE" and view.overview.rows[0][4] == "did not learn"
    assert view.overview.row_classes == ["inconclusive"]
    attack = view.attacks[0]
    assert attack.outcome == "inconclusive" and attack.advantage.startswith("INCONCLUSIVE: the attack did not learn")
    text = terminal_summary(result)
    assert text.splitlines()[0].endswith("INCONCLUSIVE: sdar did not learn") and "FAILED" not in text
    strict = result_with(untrained_sdar, strict=True)
    assert build_view(strict, with_figures=False).headline.startswith(
        "FAILED: an attack the thresholds rest on did not"
    )


def test_no_advantage_over_a_raw_input_baseline_is_a_finding_not_a_failure():
    """Zheng et al. (IJCAI 2024) Def. 1-2: clustering the embeddings worse than the raw inputs is perfect
    protection against that attack; it passes every threshold that rests on the advantage."""
    entry = get_attack("kmeans").summarize([0], [clusters(0.29, 0.80)], 1.0)
    assert entry["baseline_role"] == "raw-input" and entry["outcome"] == "no-advantage"
    assert "failed_to_train" not in entry and entry["advantage"] == pytest.approx(-0.51)
    result = result_with(entry, max_advantage=0.0, strict=True)
    assert result["gate"]["passed"], result["gate"]["reasons"]
    view = build_view(result, with_figures=False)
    assert view.overview.rows[0][1] == "no advantage" and view.overview.row_classes == ["no-advantage"]
    assert (
        "perfect protection against this attack in the sense of Zheng et al. (IJCAI 2024)" in view.attacks[0].advantage
    )
    assert not any("INCONCLUSIVE" in a for a in view.alerts)


def test_a_fine_tune_head_at_the_majority_class_did_not_learn():
    finetune = get_attack("fine-tune")
    by_k = {"1": 0.1, "5": 0.1}
    seed = SeedOutcome(
        metrics={"accuracy": 0.1, "accuracy_by_k": by_k},
        baseline={"accuracy": 0.3, "accuracy_by_k": {"1": 0.2, "5": 0.3}},
        details={"majority_accuracy": 0.1},
    )
    entry = finetune.summarize([0], [seed], 1.0)
    assert entry["outcome"] == "inconclusive"
    assert entry["failed_to_train"].startswith("its head did no better than always guessing the most frequent class")
    seed.metrics["accuracy_by_k"] = {"1": 0.15, "5": 0.2}
    assert finetune.summarize([0], [seed], 1.0)["outcome"] == "no-advantage"  # learned, below from-scratch


def test_a_trained_attack_is_not_flagged_and_an_inconclusive_one_is_not_counted_as_protection():
    sdar = get_attack("sdar")
    good = sdar.summarize([0, 1], [outcome(0.020), outcome(0.024)], 1.0)
    assert good["outcome"] == "leakage" and "failed_to_train" not in good and "spread_warning" not in good
    assert evaluate_gate({"attacks": {"sdar": good}}, strict=True)["passed"]
    bad = sdar.summarize([0], [outcome(0.080)], 1.0)
    decoder = {**good, "title": get_attack("decoder").title}  # the report names an attack by its entry's title
    result = {"attacks": {"sdar": bad, "decoder": decoder}, "run": {"quick": False}}
    result["gate"] = evaluate_gate(result)
    strongest = next(
        item for item in build_view(result, with_figures=False).summary if item.label == "Strongest attack"
    )
    assert strongest.text.startswith("Decoder") or "decoder" in strongest.text.lower()
    assert "removes 70% of the error" in strongest.text  # the decoder's 0.022 against 0.073, not sdar's


def test_a_stalled_training_signal_makes_the_attack_inconclusive_even_when_it_beats_the_baseline():
    entry = get_attack("sdar").summarize([0, 1], [outcome(0.05), outcome(0.05, not_converged="loss flat")], 1.0)
    assert entry["advantage"] > 0 and entry["failed_to_train"] == "seed 1: loss flat"
    assert entry["outcome"] == "inconclusive"
    assert not evaluate_gate({"attacks": {"sdar": entry}}, strict=True)["passed"]


def test_sdar_notices_when_its_simulator_loss_does_not_fall(digits_ctx):
    nets = SDARNets.build(digits_ctx, 0, FULL)
    nets.task_losses = [torch.tensor(2.3)] * 10
    assert nets.stalled() == ""  # too few iterations to tell
    nets.task_losses = [torch.tensor(2.3 - 0.01 * i) for i in range(40)]
    assert nets.stalled() == ""
    nets.task_losses = [torch.tensor(2.0 + 0.01 * i) for i in range(40)]
    assert nets.stalled().startswith("its own training signal did not improve (the simulator's classification")
    assert "2.02 over the first 4 iterations, 2.38 over the last 4" in nets.stalled()


def test_u_shaped_label_inference_at_the_majority_baseline_makes_sdar_inconclusive():
    labelled = SeedOutcome(
        metrics={"mse": 0.03, "label_accuracy": 0.09, "label_accuracy_relabelled": 0.5},
        baseline={"mse": 0.073, "label_accuracy": 0.092, "label_accuracy_relabelled": 0.109},
    )
    entry = get_attack("sdar").summarize([0], [labelled], 1.0)
    assert entry["advantage"] > 0 and entry["outcome"] == "inconclusive"
    assert entry["failed_to_train"].startswith(
        "its label inference did no better than the majority class (label accuracy 0.09 against 0.092); "
        "why: the classes were separated (0.5 under the best renaming) but named wrongly (0.09)"
    )
    assert "labels = clustered names the clusters" in entry["failed_to_train"]
    labelled.metrics["label_accuracy"] = 0.5
    assert "failed_to_train" not in get_attack("sdar").summarize([0], [labelled], 1.0)


def test_a_clustered_run_is_not_told_to_use_clustered_labels():
    """A failed clustered run's diagnosis points somewhere new: not at the clustered labels it already used."""
    labelled = SeedOutcome(
        metrics={"mse": 0.03, "label_accuracy": 0.09, "label_accuracy_relabelled": 0.5},
        baseline={"mse": 0.073, "label_accuracy": 0.092, "label_accuracy_relabelled": 0.109},
        details={"label_layout_agreement": 0.2},
    )
    why = get_attack("sdar").summarize([0], [labelled], 1.0)["failed_to_train"]
    assert "labels = clustered names" not in why and "instead" not in why
    assert "although labels = clustered named them by the aux classes' layout (agreement 0.2)" in why
    assert "labels = known" in why


def test_a_seed_spread_as_wide_as_the_distance_to_the_baseline_is_shown():
    """Seeds as far apart as SDAR's 0.114 ± 0.072 against a mean guess of 0.073 (here
    0.042 and 0.186 on two seeds) are flagged."""
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


def test_report_files_mark_the_inconclusive_attack_and_the_quick_run(untrained_sdar, tmp_path):
    """html, md, SARIF, JUnit and report.json (checked against the shipped schema as it is written) of
    a real audit's result with the untrained SDAR entry in it, under --strict."""
    from pathlib import Path

    from splitaudit.reports import load_result
    from splitaudit.reports.junit import write_junit
    from splitaudit.reports.sarif import sarif_log
    from splitaudit.reports.writer import write_reports

    result = load_result(Path(__file__).parent / "fixtures" / "image_audit.json")
    result["attacks"]["sdar"] = untrained_sdar
    result["run"]["quick"] = True
    result["gate"] = evaluate_gate(result, strict=True)
    write_reports(result, tmp_path, ["html", "md", "json"])
    html, md = (tmp_path / "report.html").read_text(), (tmp_path / "report.md").read_text()
    for page in (html, md):
        assert "FAILED: an attack the thresholds rest on did not learn" in page
        assert "QUICK RUN: lower bounds on leakage" in page and "INCONCLUSIVE: sdar did not learn" in page
        assert "FAILED TO TRAIN" not in page
    assert '<span class="badge inconclusive">INCONCLUSIVE</span>' in html and "(INCONCLUSIVE) ⚠️ did not learn" in md
    written = load_result(tmp_path / "report.json")
    assert written["attacks"]["sdar"]["failed_to_train"] == untrained_sdar["failed_to_train"]
    assert written["attacks"]["sdar"]["outcome"] == "inconclusive" and written["gate"]["strict"] is True
    assert [c["cause"] for c in written["gate"]["checks"] if not c["passed"]] == ["attack-inconclusive"]
    sarif = sarif_log(written)["runs"][0]
    assert [r["ruleId"] for r in sarif["results"]] == ["strict"]
    assert sarif["tool"]["driver"]["rules"][0]["shortDescription"]["text"].startswith("Every attack learned")
    junit = write_junit(written, tmp_path / "gates.xml").read_text()
    assert 'name="strict:sdar"' in junit and "sdar did not learn" in junit


# --- the gate's truth table ---------------------------------------------------------------------

BOUND = {"van_trees_mse": 0.08, "cramer_rao_mse": 0.1, "violated_by": []}


def battery(state: str) -> dict:
    """A reconstruction attack and a raw-input label attack, the first in the given state."""
    sdar = get_attack("sdar")
    entries = {
        "leakage": sdar.summarize([0], [outcome(0.09, baseline=0.1)], 1.0),  # MSE above the bound: no violation
        "no-advantage": sdar.summarize([0], [outcome(0.1, baseline=0.1)], 1.0),
        "inconclusive": sdar.summarize([0], [outcome(0.12, baseline=0.1)], 1.0),
        "errored": sdar.failed("RuntimeError: boom", 1.0),
    }
    kmeans = get_attack("kmeans").summarize([0], [clusters(0.3, 0.8)], 1.0)
    return {"attacks": {"sdar": entries[state], "kmeans": kmeans}, "bounds": BOUND, "dfil": {}, "prior": {}}


THRESHOLDS = {
    "none": {},
    "bound met": {"fail_under_mse": 0.01},
    "bound short": {"fail_under_mse": 0.5},
    "advantage cap": {"max_advantage": 0.5},
    "attack-MSE floor": {"fail_under_attack_mse": 0.01},
}
# (threshold, attack state) -> passes without --strict; with --strict only "inconclusive" changes.
PASSES = {
    ("none", "leakage"): True,
    ("none", "no-advantage"): True,
    ("none", "inconclusive"): True,
    ("bound met", "inconclusive"): True,  # the bound does not rest on an attack
    ("bound short", "leakage"): False,
    ("bound short", "inconclusive"): False,
    ("advantage cap", "leakage"): True,
    ("advantage cap", "inconclusive"): False,
    ("attack-MSE floor", "no-advantage"): True,
    ("attack-MSE floor", "inconclusive"): False,
}


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("threshold", list(THRESHOLDS))
@pytest.mark.parametrize("state", ["leakage", "no-advantage", "inconclusive", "errored"])
def test_the_gate_truth_table(threshold, state, strict):
    gate = evaluate_gate(battery(state), **THRESHOLDS[threshold], strict=strict)
    if state == "errored":  # an attack that raised leaves the audit incomplete, whatever the thresholds
        expected = False
    elif strict and state == "inconclusive":
        expected = False
    else:
        expected = PASSES.get((threshold, state), threshold != "bound short")
    assert gate["passed"] is expected, gate["reasons"]
    causes = {c["cause"] for c in gate["checks"] if not c["passed"]}
    assert ("incomplete" in causes) is (state == "errored")
    resting_on_attacks = strict or threshold in ("advantage cap", "attack-MSE floor")
    assert ("attack-inconclusive" in causes) is (state == "inconclusive" and resting_on_attacks)


# --- real models through the command line ---------------------------------------------------------


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop:
        main(args)
    return stop.value.code, capsys.readouterr().out


def test_the_peloss_sample_is_perfect_protection_against_clustering_and_fine_tuning(tmp_path, capsys):
    """Zheng et al.'s own success case (the PELoss sample) exits 0, with no advantage and no failure."""
    args = ["run", sample("digits_cnn_peloss.onnx"), "--aux", sample("digits.npz"), "--attacks", "kmeans,fine-tune"]
    code, out = run_cli(
        [*args, "--quick", "--noise-sigma", "0.1", "--fail-under-mse", "0.0001", "--out", str(tmp_path)], capsys
    )
    assert code == 0 and out.startswith("PASSED"), out
    report = json.loads((tmp_path / "report.json").read_text())
    for name in ("kmeans", "fine-tune"):
        entry = report["attacks"][name]
        assert entry["outcome"] == "no-advantage" and entry["advantage"] <= 0 and "failed_to_train" not in entry
    assert "fail" not in out.split("attack ")[-1].lower()  # the attacks table


@pytest.fixture(scope="module")
def linear_gaussian(tmp_path_factory):
    """z = 0.5 x on x ~ N(0, 0.3^2 I_8): dFIL = 0.25 / sigma^2 and, with the Gaussian prior, J/d = 1/s^2."""
    folder = tmp_path_factory.mktemp("linear")
    layer = torch.nn.Linear(8, 8, bias=False)
    with torch.no_grad():
        layer.weight.copy_(0.5 * torch.eye(8))
    torch.jit.script(layer).save(str(folder / "linear.pt"))
    x = np.random.default_rng(0).normal(0.0, 0.3, size=(400, 8)).astype(np.float32)
    np.savez(folder / "gauss.npz", x=x, y=(x[:, 0] > 0).astype(np.int64))
    return folder, x


@pytest.mark.parametrize("threshold, code", [(None, 0), ("0.001", 0), ("0.5", 1)])
def test_the_exit_code_follows_the_bound_on_a_linear_gaussian_encoder(linear_gaussian, threshold, code, capsys):
    """The old contract: bound above the threshold -> 0, below -> 1, no threshold -> 0, whatever the
    attacks find (k-means here clusters a scaled copy of the raw inputs plus noise: no advantage)."""
    folder, x = linear_gaussian
    args = ["run", str(folder / "linear.pt"), "--aux", str(folder / "gauss.npz"), "--attacks", "kmeans", "--quick"]
    args += ["--noise-sigma", "0.5", "--prior", "gaussian", "--format", "json", "--out", str(folder / "out")]
    got, out = run_cli(args + (["--fail-under-mse", threshold] if threshold else []), capsys)
    assert got == code, out
    report = json.loads((folder / "out" / "report.json").read_text())
    # van Trees: 1 / (dFIL + J/d) = 1 / (0.25 / 0.5^2 + 1 / s^2); s^2 fitted on the aux half: 3% tolerance.
    closed_form = 1.0 / (0.25 / 0.5**2 + 1.0 / x.var())
    assert report["bounds"]["van_trees_mse"] == pytest.approx(closed_form, rel=0.03)
    assert report["attacks"]["kmeans"]["outcome"] in ("no-advantage", "leakage")


def test_render_reads_a_schema_5_report_with_its_verdicts_read_anew(tmp_path):
    """Schema 5 called k-means below its raw-input baseline a failure to train and failed the gate on it;
    read now, it is the finding "no advantage", SDAR below the mean guess stays inconclusive, and the
    gate is decided anew from the report's own numbers and thresholds."""
    from pathlib import Path

    from splitaudit.reports import load_result

    stored = json.loads((Path(__file__).parent / "fixtures" / "image_audit.json").read_text())
    assert stored["schema_version"] == 5
    stored["attacks"]["kmeans"]["failed_to_train"] = "it did worse than its baseline (accuracy 0.29 against 0.8)"
    stored["attacks"]["sdar"]["failed_to_train"] = "it did worse than its baseline (mse 0.09 against 0.073)"
    stored["gate"]["checks"][0] = {**stored["gate"]["checks"][0], "passed": False, "cause": "attack-failed-to-train"}
    stored["gate"]["passed"] = False
    (tmp_path / "old.json").write_text(json.dumps(stored))
    result = load_result(tmp_path / "old.json")
    kmeans, sdar = result["attacks"]["kmeans"], result["attacks"]["sdar"]
    assert kmeans["baseline_role"] == "raw-input" and "failed_to_train" not in kmeans
    assert kmeans["outcome"] == ("leakage" if kmeans["advantage"] > 0 else "no-advantage")
    assert sdar["outcome"] == "inconclusive" and sdar["failed_to_train"].startswith("it did worse than its baseline")
    assert result["gate"]["strict"] is False
    assert result["gate"]["checks"][0] == {**result["gate"]["checks"][0], "passed": True, "cause": "complete"}
    with pytest.raises(SystemExit) as stop:
        main(["render", str(tmp_path / "old.json"), "--format", "md"])
    assert stop.value.code == 0 and "INCONCLUSIVE: sdar did not learn" in (tmp_path / "report.md").read_text()
