"""The CI gate: turn a finished result into pass/fail checks with reasons (no I/O).

Each check records its cause (splitaudit.core.result.CheckCause) and severity here, once: the
reports, SARIF and JUnit outputs read them and never re-decide a verdict."""

from __future__ import annotations

import math

from splitaudit.core.registries import GATED_BOUND
from splitaudit.verdicts.regression import compare_to_baseline, describe_row


def completeness_checks(points) -> list[dict]:
    """The gate's checks on the attacks that failed anywhere in a sweep-like document, each named by
    where it failed: `points` gives (where, that point's attacks)."""
    failed = {
        f"{name} at {where}": entry
        for where, attacks in points
        for name, entry in attacks.items()
        if entry.get("status") == "failed"
    }
    return evaluate_gate({"attacks": failed})["checks"]


def evaluate_gate(
    result: dict,
    fail_under_mse: float | None = None,
    fail_under_attack_mse: float | None = None,
    max_advantage: float | None = None,
    strict: bool = False,
    baseline: dict | None = None,
) -> dict:
    """Each check says what was measured, the threshold, and by how much it failed. Thresholds
    decide (DESIGN.md section 13): an attack that raised makes the audit incomplete; an attack that
    did not learn (outcome "inconclusive") fails only the thresholds that rest on it, and every check
    under `strict`; an attack that found no advantage over a raw-input baseline is a finding.
    baseline (verdicts.regression.baseline_summary of an earlier report): the bound must not fall, nor
    any attack's advantage grow, by more than the two audits' uncertainty allows."""
    for name, value in (
        ("fail_under_mse", fail_under_mse),
        ("fail_under_attack_mse", fail_under_attack_mse),
        ("max_advantage", max_advantage),
    ):
        if value is not None and not math.isfinite(value):  # nan passes every comparison: a false PASS
            raise ValueError(f"gate threshold {name} must be finite, got {value}")
    checks = [_completeness(result)]
    if fail_under_mse is not None:
        checks.append(_bound_check(result, fail_under_mse))
    if fail_under_attack_mse is not None:
        checks.extend(_attack_mse_checks(result, fail_under_attack_mse))
    if max_advantage is not None:
        checks.extend(_advantage_checks(result, max_advantage))
    if strict:
        checks.extend(_inconclusive_checks("strict", _inconclusive(result), "--strict"))
    if baseline is not None:
        checks.extend(_regression_checks(result, baseline))
    failed = [c for c in checks if not c["passed"]]
    return {
        "fail_under_mse": fail_under_mse,
        "fail_under_attack_mse": fail_under_attack_mse,
        "max_advantage": max_advantage,
        "strict": bool(strict),
        "passed": not failed,
        "reasons": [c["message"] for c in failed],
        "checks": checks,
        **({"baseline": baseline} if baseline is not None else {}),
    }


def threshold_checks(entry: dict, thresholds: dict, strict: bool = False) -> list[dict]:
    """evaluate_gate's checks of one audited entry (a sweep's recommended point, the recommended cut)
    without its completeness check: the sweep's and the cuts' gates check completeness at every entry."""
    return [c for c in evaluate_gate(entry, **thresholds, strict=strict)["checks"] if c["name"] != "audit-complete"]


def thresholds_of(options) -> dict:
    """The gate's keyword arguments as a run's options (core.config.AuditOptions) set them."""
    return {
        "fail_under_mse": options.fail_under_mse,
        "fail_under_attack_mse": options.fail_under_attack_mse,
        "max_advantage": options.max_advantage,
        "strict": options.strict,
    }


def _check(name: str, passed: bool, cause: str, message: str, value=None, threshold=None) -> dict:
    """A failed check is an error (it fails the gate); a passed one has no severity."""
    return {
        "name": name,
        "passed": bool(passed),
        "value": value,
        "threshold": threshold,
        "message": message,
        "cause": cause,
        "severity": "none" if passed else "error",
    }


def _completeness(result: dict) -> dict:
    """An attack that raised makes the audit incomplete: it must not pass as if it were whole. An
    attack that ran but did not learn is complete (its outcome says so); thresholds judge it."""
    failed = [name for name, a in result.get("attacks", {}).items() if a.get("status") == "failed"]
    if failed:
        return _check("audit-complete", False, "incomplete", "audit incomplete: attack(s) failed: " + ", ".join(failed))
    return _check("audit-complete", True, "complete", "every selected attack ran or was skipped with a reason")


def _inconclusive(result: dict, kind: str | None = None) -> dict[str, dict]:
    """The ok attacks (of `kind`, when given) that did not learn: they measured nothing."""
    return {
        name: a
        for name, a in result.get("attacks", {}).items()
        if a.get("status") == "ok" and a.get("outcome") == "inconclusive" and kind in (None, a.get("kind"))
    }


def _inconclusive_checks(check: str, attacks: dict[str, dict], threshold_words: str) -> list[dict]:
    """One failed check per attack that did not learn: a threshold resting on it cannot be certified."""
    return [
        _check(
            f"{check}:{name}",
            False,
            "attack-inconclusive",
            f"{name} did not learn ({a.get('failed_to_train') or 'no reason given'}), so {threshold_words} "
            "cannot be certified on it: its result measures nothing, neither leakage nor privacy",
        )
        for name, a in attacks.items()
    ]


def _prior_trusted(prior: dict) -> bool:
    """Whether the J/d the bound uses is a valid estimate or a limit that holds for every prior
    (Stam's, or infinity): a failed estimate that fell back to the Gaussian floor is neither."""
    used, limit = prior.get("J_over_d_used", math.inf), prior.get("stam_limit")
    return prior.get("valid", True) or used == math.inf or (limit is not None and used >= limit)


def _bound_check(result: dict, threshold: float) -> dict:
    bounds = result.get("bounds") or {}
    bound = bounds.get(GATED_BOUND.key)
    violated = bounds.get("violated_by") or []
    if not isinstance(bound, (int, float)) or math.isnan(bound):
        return _check(
            "fail-under-mse",
            False,
            "bound-missing",
            f"no {GATED_BOUND.name} bound was computed, so the bound gate cannot pass",
            None,
            threshold,
        )
    if (result.get("dfil") or {}).get("approximate"):
        return _check(
            "fail-under-mse",
            False,
            "bound-approximate",
            "the dFIL is approximate: its finite-difference error (black-box model) could not be bounded, "
            f"so the {GATED_BOUND.name} bound is no guarantee and the bound gate cannot pass",
            bound,
            threshold,
        )
    if not _prior_trusted(result.get("prior") or {}):
        return _check(
            "fail-under-mse",
            False,
            "prior-untrusted",
            "the prior estimate J/d failed its sanity check or did not converge and, without smoothing, no limit that holds for "
            f"every prior replaces it: the {GATED_BOUND.name} bound may be too optimistic, so the bound gate cannot pass "
            "(set --smoothing)",
            bound,
            threshold,
        )
    if violated:
        return _check(
            "fail-under-mse",
            False,
            "bound-untrusted",
            f"the {GATED_BOUND.name} bound is not trustworthy: attack(s) {', '.join(violated)} beat it",
            bound,
            threshold,
        )
    if bound < threshold:
        return _check(
            "fail-under-mse",
            False,
            "bound-too-low",
            f"{GATED_BOUND.name} bound MSE {bound:.4g} is below the threshold "
            f"{threshold:.4g} (short by {threshold - bound:.4g})",
            bound,
            threshold,
        )
    return _check(
        "fail-under-mse",
        True,
        "bound-met",
        f"{GATED_BOUND.name} bound MSE {bound:.4g} >= {threshold:.4g}",
        bound,
        threshold,
    )


def _attack_mse_checks(result: dict, threshold: float) -> list[dict]:
    """The best conclusive reconstruction MSE against the floor, and each inconclusive one as unverifiable."""
    inconclusive = _inconclusive(result, "reconstruction")
    checks = _inconclusive_checks("fail-under-attack-mse", inconclusive, "the attack-MSE floor")
    measured = {
        n: a["metrics"]["mse"]
        for n, a in result.get("attacks", {}).items()
        if a.get("status") == "ok"
        and a.get("kind") == "reconstruction"
        and n not in inconclusive
        and not math.isnan(a.get("metrics", {}).get("mse", math.nan))
    }
    if not measured:
        return checks or [
            _check(
                "fail-under-attack-mse",
                False,
                "no-reconstruction-attack",
                "no reconstruction attack ran, so the attack-MSE floor cannot be checked",
                None,
                threshold,
            )
        ]
    name = min(measured, key=measured.get)
    best = measured[name]
    if best < threshold:
        return checks + [
            _check(
                "fail-under-attack-mse",
                False,
                "attack-mse-too-low",
                f"{name} reconstructs with MSE {best:.4g}, below the floor {threshold:.4g} (by {threshold - best:.4g})",
                best,
                threshold,
            )
        ]
    return checks + [
        _check(
            "fail-under-attack-mse",
            True,
            "attack-mse-met",
            f"best reconstruction MSE {best:.4g} ({name}) >= {threshold:.4g}",
            best,
            threshold,
        )
    ]


def _advantage_checks(result: dict, cap: float) -> list[dict]:
    inconclusive = _inconclusive(result)
    checks = _inconclusive_checks("max-advantage", inconclusive, "the advantage cap")
    for name, attack in result.get("attacks", {}).items():
        if attack.get("status") != "ok" or name in inconclusive or not math.isfinite(attack.get("advantage", math.nan)):
            continue
        adv = attack["advantage"]
        message = f"{name} advantage {adv:.4g} {'<=' if adv <= cap else 'exceeds'} the cap {cap:.4g}" + (
            "" if adv <= cap else f" (by {adv - cap:.4g})"
        )
        cause = "advantage-within-cap" if adv <= cap else "advantage-too-high"
        checks.append(_check(f"max-advantage:{name}", adv <= cap, cause, message, adv, cap))
    return checks


def _regression_checks(result: dict, baseline: dict) -> list[dict]:
    """The regression test against the baseline (verdicts.regression): whether it audited the same
    inputs (said, never hidden: a warning when not), then the bound's row and each attack's."""
    comparison = compare_to_baseline(baseline, result)
    differ = comparison["input_differences"]
    against = f"against the baseline {baseline['source']}" + (f" ({'; '.join(differ)})" if differ else "")
    inputs = _check(
        "baseline-inputs",
        True,
        "baseline-other-inputs" if differ else "baseline-same-inputs",
        f"compared {against}" if differ else f"compared against the baseline {baseline['source']}: same files audited",
    )
    inputs["severity"] = "warning" if differ else "none"
    checks = [inputs]
    for row, quantity, cause in [(comparison["bound"], "bound MSE", "regression-bound")] + [
        (row, "advantage", "regression-leakage") for row in comparison["attacks"]
    ]:
        name = "regression:bound" if cause == "regression-bound" else f"regression:{row['name']}"
        passed_cause = "regression-within" if row["comparable"] else "regression-not-comparable"
        message = describe_row(row, quantity) + (f" [{against}]" if differ and row["regressed"] else "")
        value, allowed = (row["worse_by"], row["allowed"]) if row["comparable"] else (None, None)
        outcome = cause if row["regressed"] else passed_cause
        checks.append(_check(name, not row["regressed"], outcome, message, value, allowed))
    return checks


def utility_loss_check(loss: float | None, cap: float, sigma: float) -> dict:
    """The accuracy lost at the recommended sigma against --max-utility-loss (a sweep's gate)."""
    if not isinstance(loss, (int, float)) or math.isnan(loss):
        return _check(
            "max-utility-loss",
            False,
            "utility-loss-missing",
            f"the utility loss at sigma {sigma:.4g} was not measured, so the utility cap cannot be checked",
            None,
            cap,
        )
    if loss > cap:
        return _check(
            "max-utility-loss",
            False,
            "utility-loss-too-high",
            f"the recommended sigma {sigma:.4g} costs "
            f"{loss:.4g} accuracy, more than the allowed {cap:.4g} (by {loss - cap:.4g})",
            loss,
            cap,
        )
    return _check(
        "max-utility-loss",
        True,
        "utility-loss-within-cap",
        f"the recommended sigma {sigma:.4g} costs {loss:.4g} accuracy <= {cap:.4g}",
        loss,
        cap,
    )


def no_recommendation_check(reason: str, target_mse: float) -> dict:
    """A sweep with thresholds but no recommendable sigma fails: there is nothing to deploy."""
    return _check(
        "recommendation", False, "no-recommendation", "no noise sigma can be recommended: " + reason, None, target_mse
    )
