"""SDAR (paper 003) on the sample models: it reconstructs without query access, query access
does at least as well, noise hurts it, and it runs without g and on tables."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_context, sample
from splitaudit.attacks import get_attack
from splitaudit.attacks.reconstruction import reconstruction_metrics
from splitaudit.attacks.sdar import ABLATIONS, FULL, SDARNets, sdar_reconstruct, simultaneous_step


@pytest.fixture(scope="module")
def digits_top_ctx():
    """The undefended digits CNN with its top model g (quick: one seed)."""
    return make_context("digits_cnn.onnx", "digits.npz", top_model=sample("digits_cnn_top.pt"))


@pytest.fixture(scope="module")
def sdar_entry(digits_top_ctx):
    return get_attack("sdar").run(digits_top_ctx)


def test_simultaneous_step_takes_every_gradient_before_any_update():
    """Paper 003, Fig. 14: all losses come from one forward pass; each model then steps on its own
    loss. With a*b, SGD(lr=1) must give a' = a - b and b' = b - a with the old a (not a')."""
    a, b = torch.tensor(2.0, requires_grad=True), torch.tensor(3.0, requires_grad=True)
    opt_a, opt_b = torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=1.0)
    product = a * b
    simultaneous_step([(product, opt_a), (product, opt_b)])
    assert (a.item(), b.item()) == (2.0 - 3.0, 3.0 - 2.0)


def test_learning_rates_follow_paper_appendix_b_c(digits_ctx):
    """Paper 003, App. B-C: 2 eta_f~^-1 = eta_f~ = eta = 0.001, and "the learning rates for the
    discriminators are chosen as eta_d1 = lambda1 eta_f~ and eta_d2 = lambda2 eta_f~" with
    lambda1 = 0.02, lambda2 = 1e-5 (Table VII). Lambda is thus both the adversarial weight in the
    generator's loss and the discriminator's learning-rate factor, not only the former."""
    nets = SDARNets.build(digits_ctx, 0, FULL)
    lr = {name: getattr(nets, f"{name}_opt").param_groups[0]["lr"]
          for name in ("simulator", "decoder", "d1", "d2")}
    assert lr["simulator"] == pytest.approx(1e-3)
    assert lr["decoder"] == pytest.approx(lr["simulator"] / 2)
    assert lr["d1"] == pytest.approx(0.02 * lr["simulator"])
    assert lr["d2"] == pytest.approx(1e-5 * lr["simulator"])


@pytest.mark.slow
def test_sdar_beats_the_mean_guess_and_query_access_beats_sdar(digits_top_ctx, sdar_entry):
    """Issue 5: undefended digits CNN with g. Query access (the decoder attack) is worth something."""
    decoder = get_attack("decoder").run(digits_top_ctx)
    assert sdar_entry["status"] == "ok", sdar_entry.get("reason")
    assert sdar_entry["metrics"]["mse"] < 0.75 * sdar_entry["baseline"]["mse"]
    assert decoder["metrics"]["mse"] <= sdar_entry["metrics"]["mse"]


def test_sdar_uses_g_and_the_targets_labels_and_keeps_examples(sdar_entry):
    details = sdar_entry["details"]
    assert details["classifier"] == "top model g (frozen)"
    assert details["simulator"] == "bottom model's architecture, re-initialised"
    assert details["target_labels"].startswith("the targets' own labels")
    assert "target_label_accuracy" not in details
    assert [e["label"] for e in sdar_entry["examples"]] == ["best", "median", "worst"]


def test_sdar_can_predict_the_labels_with_g(digits_top_ctx):
    """A server without the targets' labels labels them with g, which was trained on f's
    embeddings, so its labels are nearly right."""
    options = {"sdar": {"labels": "predicted", "iterations": 30}}
    entry = get_attack("sdar").run(dataclasses.replace(digits_top_ctx, attack_options=options))
    assert entry["details"]["target_labels"].startswith("predicted")
    assert entry["details"]["target_label_accuracy"] > 0.9


@pytest.mark.slow
def test_removing_d1_makes_the_reconstruction_worse(digits_ctx):
    """Issue 5 / paper 003's ablation (about 3x on CIFAR-10). Without g only d1 ties the simulator
    to f: the decoder soon fits f~'s embeddings, but the target MSE stays above the mean guess
    (0.073) until d1 has pulled f~ onto f's embeddings, from ~1000 iterations on. Digits CNN,
    targets' labels, 2000 iterations, the same seed for both (about 90 s on one core): seed 0
    gave 0.028 with d1 and 0.112 without (4x); seeds 1 and 2 were slower to align (0.044 and
    0.060 with d1 at 2000, 0.025 and 0.031 at 2500). Asserted: at least 1.5x worse without d1."""
    observed = digits_ctx.observed_embeddings("target", digits_ctx.generator(0))
    target = digits_ctx.target

    def mse(regularizers):
        x_hat, _ = sdar_reconstruct(digits_ctx, observed, target.y, 0, 2000, 32, regularizers)
        return reconstruction_metrics(target.x, x_hat, target.is_image)["mse"]

    assert mse(ABLATIONS["mse_no_d1"]) > 1.5 * mse(FULL)


def test_ablation_option_adds_one_mse_per_variant(digits_top_ctx):
    options = {"sdar": {"ablation": True, "iterations": 30}}
    entry = get_attack("sdar").run(dataclasses.replace(digits_top_ctx, attack_options=options))
    metrics = entry["metrics"]
    assert set(metrics) == {"mse", "psnr", "ssim", "mse_no_d1", "mse_no_d2"}
    assert entry["details"]["iterations"] == 30
    assert metrics["mse_no_d1"] != metrics["mse"] and metrics["mse_no_d2"] != metrics["mse"]


def test_large_noise_raises_sdar_mse(digits_top_ctx, sdar_entry):
    noisy = get_attack("sdar").run(dataclasses.replace(digits_top_ctx, noise_sigma=3.0))
    assert noisy["metrics"]["mse"] > 1.3 * sdar_entry["metrics"]["mse"]


def test_sdar_runs_without_a_top_model_on_a_jointly_trained_head(digits_ctx):
    entry = get_attack("sdar").run(digits_ctx)
    assert entry["status"] == "ok", entry.get("reason")
    assert entry["details"]["classifier"] == "head trained jointly"
    assert 0 < entry["metrics"]["mse"] < 1


def test_sdar_runs_on_tabular_data_with_its_top_model():
    """Runs with flat inputs and embeddings (MLP decoder and discriminators). On 285 aux rows
    with a binary label it is unstable (seed 0 with g: 0.013 at 600 iterations, 0.059 at 2000;
    mean guess 0.021; paper 003 evaluates images only), so only sanity is asserted."""
    ctx = make_context("breast_cancer_mlp.onnx", "breast_cancer.npz",
                       top_model=sample("breast_cancer_mlp_top.pt"))
    entry = get_attack("sdar").run(ctx)
    assert entry["status"] == "ok", entry.get("reason")
    assert "ssim" not in entry["metrics"]
    assert 0 < entry["metrics"]["mse"] < 3 * entry["baseline"]["mse"]
    assert entry["examples"][0]["shape"] == [29]


def test_sdar_is_skipped_without_labels(digits_top_ctx):
    unlabelled = dataclasses.replace(digits_top_ctx, aux=dataclasses.replace(digits_top_ctx.aux, y=None))
    entry = get_attack("sdar").run(unlabelled)
    assert entry["status"] == "skipped" and "labels" in entry["reason"]
