"""One conformance suite every registered attack passes (like scikit-learn's check_estimator):
it declares its needs, skips cleanly with a reason, fills its metrics and baseline, is
reproducible for a fixed seed, and handles noisy embeddings."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from conftest import make_context
from splitaudit.attacks import ATTACK_NAMES, get_attack
from splitaudit.attacks.base import NEEDS

EXPECTED_METRICS = {
    "fine-tune": {"accuracy", "accuracy_by_k"},
    "kmeans": {"accuracy", "nmi", "ari"},
    "attribute": {"accuracy", "auc"},
    "decoder": {"mse", "psnr", "ssim"},
    "optimization": {"mse", "psnr", "ssim"},
    "sdar": {"mse", "psnr", "ssim"},
}

pytestmark = pytest.mark.slow


def test_registry_covers_the_cli_contract():
    assert set(ATTACK_NAMES) == set(EXPECTED_METRICS)


@pytest.mark.parametrize("name", ATTACK_NAMES)
def test_attack_declares_its_contract(name):
    attack = get_attack(name)
    assert attack.name == name
    assert attack.kind in {"label", "reconstruction"}
    assert attack.primary_metric == ("mse" if attack.kind == "reconstruction" else "accuracy")
    assert set(attack.needs) <= NEEDS
    assert len(attack.assumptions) > 20, "the report shows what the attacker is assumed to hold"


@pytest.mark.parametrize("name", ATTACK_NAMES)
def test_attack_runs_fills_metrics_and_is_reproducible(name, digits_ctx):
    first, second = get_attack(name).run(digits_ctx), get_attack(name).run(digits_ctx)
    assert first["status"] == "ok", first.get("reason")
    assert EXPECTED_METRICS[name] <= set(first["metrics"])
    assert first["primary_metric"] in first["baseline"]
    assert math.isfinite(first["advantage"]) and first["seconds"] > 0
    json.dumps(first)  # report.json must be able to hold it
    assert flat(first["metrics"]) == pytest.approx(flat(second["metrics"]), rel=1e-5, abs=1e-6), \
        "same seed, same result"


def flat(metrics: dict, prefix: str = "") -> dict:
    """Nested metric dicts (e.g. accuracy_by_k) as one flat dict, for approximate comparison."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


@pytest.mark.parametrize("name", ATTACK_NAMES)
def test_attack_handles_noisy_embeddings(name, digits_ctx):
    noisy = dataclasses.replace(digits_ctx, noise_sigma=5.0)
    entry = get_attack(name).run(noisy)
    assert entry["status"] == "ok", entry.get("reason")
    primary = entry["metrics"][entry["primary_metric"]]
    assert math.isfinite(primary)


@pytest.mark.parametrize("name", ATTACK_NAMES)
def test_attack_skips_with_a_reason_when_inputs_lack_what_it_needs(name, digits_ctx):
    unlabelled = dataclasses.replace(
        digits_ctx,
        aux=dataclasses.replace(digits_ctx.aux, y=None, attr=None),
        target=dataclasses.replace(digits_ctx.target, y=None, attr=None),
    )
    attack = get_attack(name)
    entry = attack.run(unlabelled)
    if attack.needs & {"labels", "attribute"}:
        assert entry["status"] == "skipped" and entry["reason"]
    else:
        assert entry["status"] == "ok", entry.get("reason")


@pytest.mark.parametrize("name", ATTACK_NAMES)
def test_gradient_attacks_skip_black_box_models(name, digits_ctx):
    blackbox = dataclasses.replace(digits_ctx, encoder=dataclasses.replace(digits_ctx.encoder, torch_fn=None))
    attack = get_attack(name)
    reason = attack.missing(blackbox)
    assert (reason is not None) == ("gradients" in attack.needs)


def test_tabular_data_runs_every_attack_without_ssim():
    ctx = make_context("breast_cancer_mlp.onnx", "breast_cancer.npz")
    for name in ATTACK_NAMES:
        entry = get_attack(name).run(ctx)
        assert entry["status"] == "ok", (name, entry.get("reason"))
        assert "ssim" not in entry["metrics"]
