"""`splitaudit calibrate`: the noise sigma that makes the gated (van Trees) bound reach a target MSE,
from one leakage measurement (the calibration section of leakage.py, without a report)."""

from __future__ import annotations

from splitaudit.context.audit_context import AuditContext
from splitaudit.core.registries import BOUNDS, GATED_BOUND
from splitaudit.stages.leakage import DFIL_RTOL, Measurement, calibration_section, measure


def calibrate(
    ctx: AuditContext,
    target_mse: float,
    prior: str = "ssm",
    smoothing: float | None = None,
    dfil_rtol: float = DFIL_RTOL,
    dfil_samples: int | None = None,
) -> dict:
    """The answer of `splitaudit calibrate --json`: the sigma for the gated bound (and each other
    registered bound) to reach target_mse, or why no sigma can."""
    return calibration_answer(ctx, measure(ctx, prior, smoothing, dfil_rtol, dfil_samples), target_mse)


def calibration_answer(ctx: AuditContext, m: Measurement, target_mse: float) -> dict:
    """calibrate's answer from an existing measurement."""
    answer = calibration_section(ctx, m, target_mse)
    del answer["target_source"]
    return {
        **answer,
        "prior": {
            "method": m.prior.method,
            "J_over_d": m.prior.j_over_d,
            "valid": m.prior.valid,
            "notes": list(m.prior.notes),
        },
        "dfil_method": m.traces.method,
        "dfil_approximate": m.mean_trace.approximate,
        "n_samples": len(m.index),
    }


def describe_calibration(answer: dict) -> str:
    """One or two lines for people: the sigma, or why none exists; then what each other bound asks."""
    where = f" (bound on the smoothed input, tau = {answer['smoothing']:g})" if answer["smoothing"] > 0 else ""
    caveat = (
        "\nThe dFIL is approximate (black-box finite differences whose error could not be bounded): "
        "this sigma is no guarantee."
        if answer.get("dfil_approximate")
        else ""
    )
    others = [bound for bound in BOUNDS.values() if not bound.gated and answer.get(bound.sigma_key) is not None]
    if not answer["feasible"]:
        return (
            f"no noise sigma reaches a {GATED_BOUND.name} bound of {answer['target_mse']:.4g}: {answer['reason']}."
            + "".join(f"\nAgainst {b.audience} only, sigma = {answer[b.sigma_key]:.4g} would suffice." for b in others)
            + caveat
        )
    return (
        f"noise sigma {answer['sigma']:.4g} makes the {GATED_BOUND.name} bound reach MSE {answer['target_mse']:.4g}"
        f"{where}, prior {answer['prior']['method']}."
        + "".join(f"\nAgainst {b.audience} only ({b.name}), sigma {answer[b.sigma_key]:.4g} suffices." for b in others)
        + caveat
    )
