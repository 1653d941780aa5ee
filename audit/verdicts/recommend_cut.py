"""Where to split, from the cuts' numbers alone: the recommended cut and the gate of `splitaudit cuts`.

Pure functions of cuts.json's content (no model, no torch), so `cuts` writes them and a saved
cuts.json is checked against them by the same code (splitaudit.reports.consistency), as a sweep's
recommendation is. A cut qualifies when its van Trees bound (Maeng et al., NeurIPS 2023) at its
noise reaches the target, no attack beats that bound, and the noise costs the real top model at most
the allowed accuracy; the recommendation is the qualifying cut that costs the client the fewest
FLOPs (the earlier cut on a tie).
"""

from __future__ import annotations

from splitaudit.core.registries import GATED_BOUND
from splitaudit.verdicts.gate import completeness_checks, no_recommendation_check, threshold_checks
from splitaudit.verdicts.recommend import reaches

LOSS_ATOL = 1e-9  # an accuracy loss equal to the budget qualifies (1 - 0.98 is 0.020000000000000018 in floats)


def _loss(cut: dict) -> float | None:
    loss = (cut.get("utility") or {}).get("loss")
    return loss if isinstance(loss, (int, float)) else None


def _bound(cut: dict):
    return cut["bounds"][GATED_BOUND.key]


def qualifies(cut: dict, target_mse: float, max_accuracy_loss: float) -> bool:
    """The bound at the cut's noise reaches the target, no attack beats it, and the accuracy lost is in budget."""
    loss = _loss(cut)
    return (
        reaches(_bound(cut), target_mse)
        and not cut["bounds"]["violated_by"]
        and loss is not None
        and loss <= max_accuracy_loss + LOSS_ATOL
    )


def recommend_cut(cuts: list[dict], target_mse: float, max_accuracy_loss: float) -> dict:
    """The qualifying cut with the fewest client FLOPs (ties: the earliest), or why none qualifies."""
    entry = {"target_mse": target_mse, "max_accuracy_loss": max_accuracy_loss}
    good = [i for i, cut in enumerate(cuts) if qualifies(cut, target_mse, max_accuracy_loss)]
    if not good:
        return {
            **entry,
            "cut": None,
            "cut_index": None,
            "noise_sigma": None,
            GATED_BOUND.key: None,
            "accuracy_loss": None,
            "flops": None,
            "reason": _no_cut(cuts, target_mse, max_accuracy_loss),
        }
    best = min(good, key=lambda i: (cuts[i]["flops"], i))
    cut = cuts[best]
    return {
        **entry,
        "cut": cut["name"],
        "cut_index": best,
        "noise_sigma": cut["noise_sigma"],
        GATED_BOUND.key: _bound(cut),
        "accuracy_loss": _loss(cut),
        "flops": cut["flops"],
        "reason": _words(cut, len(good), target_mse, max_accuracy_loss),
    }


def _words(cut: dict, qualifying: int, target_mse: float, max_loss: float) -> str:
    utility = cut["utility"]
    return (
        f"cut at {cut['name']} ({cut['op']}): the cheapest of the {qualifying} qualifying cut(s) for the client "
        f"({cut['flops']:,} FLOPs, {cut['params']:,} parameters, {cut['bytes_sent']:,} bytes sent per sample); with "
        f"noise sigma {cut['noise_sigma']:.4g} its {GATED_BOUND.name} bound (MSE {_bound(cut):.4g}) reaches the target "
        f"{target_mse:.4g} and the top model's accuracy goes {utility['clean_accuracy']:.4g} -> "
        f"{utility['accuracy']:.4g} (loss {_loss(cut):.4g} <= {max_loss:.4g})"
    )


def _no_cut(cuts: list[dict], target_mse: float, max_loss: float) -> str:
    """Why no cut qualifies, and what would make one."""
    if not cuts:
        return "no cut was audited"
    reaching = [c for c in cuts if reaches(_bound(c), target_mse)]
    if not reaching and all(c["sigma_source"] == "uncalibrated" for c in cuts):
        reason = cuts[0]["calibration"]["reason"]
        return f"no noise sigma makes the {GATED_BOUND.name} bound reach MSE {target_mse:.4g} at any cut ({reason})"
    if not reaching:
        top = max(cuts, key=lambda c: _bound(c) if isinstance(_bound(c), (int, float)) else float("-inf"))
        return (
            f"no cut's {GATED_BOUND.name} bound reaches MSE {target_mse:.4g} at its noise; the largest is "
            f"{_bound(top):.4g} at {top['name']} (sigma {top['noise_sigma']:.4g}): add more noise (leave --noise-sigma "
            "out to calibrate each cut) or lower --target-mse"
        )
    trusted = [c for c in reaching if not c["bounds"]["violated_by"]]
    if not trusted:
        beaten = "; ".join(f"{c['name']} by {', '.join(c['bounds']['violated_by'])}" for c in reaching)
        return f"every cut whose bound reaches MSE {target_mse:.4g} is beaten by an attack ({beaten}): no guarantee"
    measured = [c for c in trusted if _loss(c) is not None]
    if not measured:
        return "the accuracy under noise is unknown at every cut that reaches the bound (the data has no labels?)"
    least = min(measured, key=lambda c: (_loss(c), c["flops"]))
    return (
        f"every cut that reaches the bound MSE {target_mse:.4g} costs more than {max_loss:.4g} accuracy; the least is "
        f"{_loss(least):.4g} at {least['name']} (sigma {least['noise_sigma']:.4g}): allow --max-accuracy-loss "
        f"{_loss(least):.4g}, lower --target-mse, or cut later in the model (a later cut usually leaks less and needs "
        "less noise)"
    )


def cuts_gate(
    document: dict,
    fail_under_mse: float | None = None,
    fail_under_attack_mse: float | None = None,
    max_advantage: float | None = None,
    strict: bool = False,
) -> dict:
    """The run's gates on the recommended cut, and completeness at every cut; with a threshold and no
    recommendable cut, the gate fails (there is nothing to deploy)."""
    checks = completeness_checks((cut["name"], cut["attacks"]) for cut in document["cuts"])
    rec = document["recommendation"]
    thresholds = {
        "fail_under_mse": fail_under_mse,
        "fail_under_attack_mse": fail_under_attack_mse,
        "max_advantage": max_advantage,
    }
    if rec["cut_index"] is not None:
        cut = {**document["cuts"][rec["cut_index"]], "prior": document["prior"]}
        checks += threshold_checks(cut, thresholds, strict)
    elif any(v is not None for v in thresholds.values()):
        check = no_recommendation_check(rec["reason"], rec["target_mse"])
        checks.append({**check, "message": "no cut can be recommended: " + rec["reason"]})
    failed = [c for c in checks if not c["passed"]]
    return {
        **thresholds,
        "strict": strict,
        "passed": not failed,
        "reasons": [c["message"] for c in failed],
        "checks": checks,
    }
