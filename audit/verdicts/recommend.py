"""The sweep's verdict from its points alone: the recommended sigma and the sweep's gate.

Pure functions of sweep.json's content (no model, no torch), so the sweep writes them and a saved
sweep.json is checked against them by the same code (splitaudit.reports.consistency). The
recommendation is the smallest audited sigma whose van Trees bound (Maeng et al., NeurIPS 2023)
reaches the target and that no attack beats, with what it costs in accuracy.
"""

from __future__ import annotations

import math

from splitaudit.core.registries import GATED_BOUND
from splitaudit.verdicts.gate import completeness_checks, no_recommendation_check, threshold_checks, utility_loss_check

REACHES_RTOL = 1e-9  # the calibrated sigma's bound equals the target up to rounding


def reaches(bound, target: float) -> bool:
    """Whether a bound MSE reaches the target (up to rounding in the calibrated sigma)."""
    return isinstance(bound, (int, float)) and math.isfinite(bound) and bound >= target * (1 - REACHES_RTOL)


def recommend(
    points: list[dict], target_mse: float, max_utility_loss: float | None = None, auto_sigma_reason: str | None = None
) -> dict:
    """The smallest audited sigma whose van Trees bound reaches target_mse and that no attack
    beats, with its utility loss and whether that loss is within max_utility_loss
    (auto_sigma_reason: what --auto-sigma's calibration said, when it was asked for)."""
    safe = [p for p in points if reaches(p["bounds"][GATED_BOUND.key], target_mse) and not p["bounds"]["violated_by"]]
    entry = {"target_mse": target_mse, "max_utility_loss": max_utility_loss}
    if not safe:
        return {
            **entry,
            "noise_sigma": None,
            "point_index": None,
            GATED_BOUND.key: None,
            "utility_loss": None,
            "meets_utility": None,
            "reason": _no_safe_point(points, target_mse, auto_sigma_reason),
        }
    best = min(safe, key=lambda p: p["noise_sigma"])
    loss = best["utility"].get("loss")
    meets = None if max_utility_loss is None or loss is None else loss <= max_utility_loss
    return {
        **entry,
        "noise_sigma": best["noise_sigma"],
        "point_index": points.index(best),
        GATED_BOUND.key: best["bounds"][GATED_BOUND.key],
        "utility_loss": loss,
        "meets_utility": meets,
        "reason": _recommendation_words(best, target_mse, max_utility_loss, meets),
    }


def _no_safe_point(points: list[dict], target_mse: float, auto_sigma_reason: str | None) -> str:
    reaching = [p for p in points if reaches(p["bounds"][GATED_BOUND.key], target_mse)]
    if reaching:
        beaten = "; ".join(f"sigma {p['noise_sigma']:.4g} by {', '.join(p['bounds']['violated_by'])}" for p in reaching)
        return (
            f"every audited sigma whose {GATED_BOUND.name} bound reaches MSE {target_mse:.4g} is beaten by an attack "
            f"({beaten}), so the bound is no guarantee there: no sigma can be recommended"
        )
    finite = [p for p in points if math.isfinite(p["bounds"][GATED_BOUND.key])]
    top = max(finite, key=lambda p: p["bounds"][GATED_BOUND.key]) if finite else None
    largest = f"; the largest is {top['bounds'][GATED_BOUND.key]:.4g} at sigma {top['noise_sigma']:.4g}" if top else ""
    hint = "or use --auto-sigma" if auto_sigma_reason is None else f"--auto-sigma: {auto_sigma_reason}"
    return f"no audited sigma gives a {GATED_BOUND.name} bound of at least MSE {target_mse:.4g}{largest}: audit larger sigmas ({hint})"


def _recommendation_words(point: dict, target_mse: float, max_loss: float | None, meets: bool | None) -> str:
    sigma, bound = point["noise_sigma"], point["bounds"][GATED_BOUND.key]
    checked = [n for n, a in point["attacks"].items() if a.get("kind") == "reconstruction" and a.get("status") == "ok"]
    words = (
        f"sigma {sigma:.4g} is the smallest audited noise whose {GATED_BOUND.name} bound (MSE {bound:.4g}) reaches the "
        f"target {target_mse:.4g}"
    )
    words += (
        f" and no attack beats it (checked by {', '.join(checked)})"
        if checked
        else " (no reconstruction attack ran at it, so the bound was not checked empirically)"
    )
    loss = point["utility"].get("loss")
    if loss is None:
        return words + "; its utility loss is unknown (" + (point["utility"].get("reason") or "not measured") + ")"
    words += f"; it costs {loss:.4g} accuracy ({point['utility']['clean_accuracy']:.4g} -> {point['utility']['accuracy']:.4g})"
    if meets is False:
        words += (
            f", MORE than the allowed utility loss {max_loss:.4g}: the target bound cannot be met within the "
            "utility limit (no smaller audited sigma reaches the bound)"
        )
    elif meets:
        words += f", within the allowed utility loss {max_loss:.4g}"
    return words


def sweep_gate(
    sweep: dict,
    fail_under_mse: float | None = None,
    fail_under_attack_mse: float | None = None,
    max_advantage: float | None = None,
    max_utility_loss: float | None = None,
    strict: bool = False,
) -> dict:
    """The run's gates on the recommended point, the utility cap, and completeness at every point
    (from sweep.json's content alone, so that a rendered sweep.json can be checked against it)."""
    checks = completeness_checks((f"sigma {p['noise_sigma']:.4g}", p["attacks"]) for p in sweep["points"])
    rec = sweep["recommendation"]
    thresholds = {
        "fail_under_mse": fail_under_mse,
        "fail_under_attack_mse": fail_under_attack_mse,
        "max_advantage": max_advantage,
    }
    if rec["noise_sigma"] is not None:
        checks += threshold_checks(sweep["points"][rec["point_index"]], thresholds, strict)
    elif any(v is not None for v in thresholds.values()) or max_utility_loss is not None:
        checks.append(no_recommendation_check(rec["reason"], rec["target_mse"]))
    if max_utility_loss is not None and rec["noise_sigma"] is not None:
        checks.append(utility_loss_check(rec["utility_loss"], max_utility_loss, rec["noise_sigma"]))
    failed = [c for c in checks if not c["passed"]]
    return {
        **thresholds,
        "strict": strict,
        "max_utility_loss": max_utility_loss,
        "passed": not failed,
        "reasons": [c["message"] for c in failed],
        "checks": checks,
    }
