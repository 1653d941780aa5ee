"""The executive summary: the verdict, the provable protection in plain words, the strongest
attack, the recommended noise, the utility at the audited noise, and what the tokens leak.
"""

from __future__ import annotations

import math
from typing import Any

from splitaudit.core.registries import BOUNDS, GATED_BOUND
from splitaudit.reports.formatting import advantage_words, is_finite, is_number, mean_std, number, text
from splitaudit.reports.tokens import token_statement_words
from splitaudit.reports.view_attacks import attack_title
from splitaudit.reports.view_elements import METRIC_LABELS, Item, outcome, ran_ok, section, trained
from splitaudit.reports.view_verdict import verdict_class, verdict_text


def summary_items(result: dict, attacks: dict[str, dict]) -> list[Item]:
    tone = {"pass": "good", "fail": "bad"}.get(verdict_class(result), "info")
    items = [Item("Verdict", verdict_text(result), tone)]
    items.append(_protection(result, attacks))
    items.append(_strongest(attacks))
    calibration = section(result, "calibration")
    if calibration:
        items.append(_recommended_noise(calibration, result.get("noise_sigma")))
    if section(result, "utility"):
        items.append(Item("Utility", utility_words(section(result, "utility")), "info"))
    if section(result, "tokens"):
        items.append(Item("In tokens", token_statement_words(section(result, "tokens")), "info"))
    return items


def utility_words(utility: dict) -> str:
    """Task accuracy at the audited noise, its loss against sigma = 0, and how it was measured."""
    if utility.get("status") != "ok":
        return f"Not measured: {utility.get('reason') or 'no reason given'}."
    words = f"task accuracy {mean_std(utility.get('accuracy'), utility.get('accuracy_std'))}"
    if is_finite(utility.get("loss")) and utility.get("noise_sigma") != 0:
        words += f", {number(utility['loss'])} below the {number(utility.get('clean_accuracy'))} it has without noise"
    return (
        f"At σ = {number(utility.get('noise_sigma'))}: {words} ({utility.get('description') or utility.get('source')})."
    )


def _mean_guess_mse(attacks: dict[str, dict]) -> float | None:
    """The mean-guess MSE that every reconstruction attack reports as its baseline."""
    values = [
        a["baseline"]["mse"]
        for a in attacks.values()
        if ran_ok(a) and a.get("kind") == "reconstruction" and is_finite((a.get("baseline") or {}).get("mse"))
    ]
    return values[0] if values else None


def _protection(result: dict, attacks: dict[str, dict]) -> Item:
    """The provable bound in plain words (or plainly: nothing is guaranteed)."""
    bounds = section(result, "bounds")
    bound = bounds.get(GATED_BOUND.key)
    sigma = result.get("noise_sigma")
    if not is_number(bound):
        return Item("Provable protection", f"Not computed: the result holds no {GATED_BOUND.name} bound.", "warn")
    if bound <= 0 or not math.isfinite(bound):
        cause = (
            "the embeddings are sent without noise (σ = 0), so the Fisher information is infinite"
            if sigma == 0
            else "the Fisher information is infinite"
        )
        return Item(
            "Provable protection",
            f"Nothing is guaranteed: {cause} and the provable bound is 0. "
            "An attacker may in principle recover the inputs exactly.",
            "bad",
        )
    smoothing = section(result, "prior").get("smoothing")
    words = (
        f"No attacker can reconstruct inputs with a mean squared error below {number(bound)} "
        f"(per input dimension, on average over inputs like the audited data; {GATED_BOUND.name} bound"
    )
    words += (
        f", for inputs smoothed with noise τ = {number(smoothing)})."
        if is_finite(smoothing) and smoothing > 0
        else ")."
    )
    guess = _mean_guess_mse(attacks)
    if guess is not None:
        words += f" For scale: guessing the average input gives MSE {number(guess)}."
    violated = bounds.get("violated_by") or []
    if violated:
        return Item(
            "Provable protection", words + f" But {text(violated)} beat this bound, so it cannot be trusted.", "bad"
        )
    return Item("Provable protection", words, "info")


def _strongest(attacks: dict[str, dict]) -> Item:
    """The attack with the largest advantage among those that learned (an inconclusive one measured nothing)."""
    ran = {n: a for n, a in attacks.items() if trained(a) and is_finite(a.get("advantage"))}
    inconclusive = [n for n, a in attacks.items() if outcome(a) == "inconclusive"]
    if not ran:
        if inconclusive:
            return Item(
                "Strongest attack",
                f"No attack learned: {text(inconclusive)} measured nothing, which is not evidence of privacy.",
                "bad",
            )
        return Item("Strongest attack", "No attack produced a result.", "warn" if attacks else "info")
    name = max(ran, key=lambda n: ran[n]["advantage"])
    attack = ran[name]
    metric = attack.get("primary_metric", "")
    value = (attack.get("metrics") or {}).get(metric)
    base = (attack.get("baseline") or {}).get(metric)
    words = (
        f"{attack_title(name, attack)}: {METRIC_LABELS.get(metric, metric)} {number(value)} "
        f"against {number(base)} for its baseline; "
        f"{advantage_words(attack.get('kind', ''), attack['advantage'])}."
    )
    if attack["advantage"] > 0:
        return Item("Strongest attack", words, "bad")
    return Item("Strongest attack", "No attack that learned found an advantage; the closest, " + words, "good")


def _smoothing_condition(calibration: dict) -> str:
    smoothing = calibration.get("smoothing")
    return f", for inputs smoothed with noise τ = {number(smoothing)}" if is_finite(smoothing) and smoothing > 0 else ""


def _recommended_noise(calibration: dict, current: Any) -> Item:
    target = number(calibration.get("target_mse"))
    sigma = calibration.get("sigma")
    now = f" (currently σ = {number(current)})" if is_number(current) else ""
    if calibration.get("feasible") is False or not is_finite(sigma):
        reason = calibration.get("reason") or "the prior alone lets an attacker do better"
        return Item(
            "Recommended noise", f"No amount of embedding noise can guarantee MSE ≥ {target}: {reason}.", "warn"
        )
    words = (
        f"Gaussian noise with σ = {number(sigma)} on the embeddings guarantees MSE ≥ {target} "
        f"against any attacker{_smoothing_condition(calibration)}{now}."
    )
    for bound in (b for b in BOUNDS.values() if not b.gated and is_finite(calibration.get(b.sigma_key))):
        words += f" Against {bound.audience} only, σ = {number(calibration[bound.sigma_key])} would suffice."
    return Item("Recommended noise", words, "info")
