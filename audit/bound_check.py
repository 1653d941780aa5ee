"""The attacks' check against the gated bound: an attack that reconstructs below the van Trees
bound by more than its error margin shows the bound's assumptions failed (Maeng et al., NeurIPS
2023), and the result says so with the likely causes. Pure functions of the result's sections."""

from __future__ import annotations

import math

from splitaudit.registries import GATED_BOUND

VIOLATION_Z = 2.0  # an attack violates the bound when it is below it by this many standard errors


def check_against_bound(bounds: dict, attacks: dict[str, dict], smoothing: float) -> tuple[dict, dict]:
    """(attacks, bounds) as new sections: each ok reconstruction attack with its bound_check, and
    the bounds listing (with the likely causes) every one whose MSE is below the van Trees bound
    by more than VIOLATION_Z standard errors (attack spread over seeds and the bound's own error).
    The sections given are left as they are, so a result is assembled once, already checked."""
    bound, bound_se = bounds[GATED_BOUND.key], bounds.get(GATED_BOUND.stderr_key, 0.0)
    checked, violated = {}, []
    for name, attack in attacks.items():
        if attack.get("status") != "ok" or attack.get("kind") != "reconstruction":
            checked[name] = attack
            continue
        mse = attack["metrics"]["mse"]
        spread = attack.get("metrics_std", {}).get("mse", 0.0)
        margin = VIOLATION_Z * math.hypot(spread if math.isfinite(spread) else 0.0, bound_se)
        checked[name] = {
            **attack,
            "bound_check": {GATED_BOUND.key: bound, "margin": margin, "violated": mse < bound - margin},
        }
        if mse < bound - margin:
            violated.append(name)
    flagged = {**bounds, "violated_by": violated}
    if violated:
        causes = violation_causes(smoothing)
        flagged["violation_causes"] = causes
        flagged["notes"] = [
            *bounds.get("notes", []),
            f"{', '.join(violated)} reconstructed below the {GATED_BOUND.name} bound: the bound's assumptions failed "
            f"({'; '.join(causes)}), so it is not a guarantee here",
        ]
    return checked, flagged


def violation_causes(smoothing: float) -> list[str]:
    """Why an attack can beat the van Trees bound, likeliest first."""
    causes = [
        "the prior term J may be underestimated (score matching struggles with data near a low-dimensional manifold)"
    ]
    if smoothing > 0:
        causes.insert(
            0,
            f"the bound covers inputs smoothed with noise tau = {smoothing:g} (Maeng et al., NeurIPS 2023, A.1) while "
            "the attacks reconstruct the clean inputs, so it applies only if the client smooths its inputs",
        )
    return causes
