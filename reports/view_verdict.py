"""The gate's verdict as a report shows it: the headline, the verdict's colour class, the
sentence on what passed or failed, the alerts a reader must not miss, and the table of gate checks.
"""

from __future__ import annotations

from splitaudit.reports.formatting import is_number, number, text
from splitaudit.reports.view_elements import Table, attack_entries, gate_section, outcome, ran_ok, section

QUICK_ALERT = (
    "QUICK RUN: fewer seeds, epochs and iterations, so the attacks are under-trained and each "
    "measures only a lower bound on the leakage; a model that looks private here may leak under full settings."
)


CAUSE_WORDS = {
    "incomplete": "the audit is incomplete",
    "attack-inconclusive": "an attack the thresholds rest on did not learn (it measured nothing)",
    "bound-too-low": "the provable bound is too low",
    "bound-untrusted": "the provable bound cannot be trusted",
    "bound-approximate": "the provable bound rests on an approximate dFIL",
    "prior-untrusted": "the provable bound rests on a failed prior estimate",
    "bound-missing": "no provable bound was computed",
    "attack-mse-too-low": "an attack reconstructs too well",
    "no-reconstruction-attack": "no reconstruction attack ran",
    "advantage-too-high": "an attack's advantage is above the cap",
    "utility-loss-too-high": "the recommended noise costs too much accuracy",
    "utility-loss-missing": "the utility loss was not measured",
    "no-recommendation": "no noise sigma can be recommended",
    "regression-bound": "the provable bound fell since the baseline, beyond the noise of the two measurements",
    "regression-leakage": "the leakage of an attack grew since the baseline, beyond the noise of the two measurements",
}


def _failure_kind(check: dict) -> str:
    """A failed check's cause, as the gate recorded it, in a few words."""
    return CAUSE_WORDS.get(check["cause"], str(check.get("message", "")))


def _failed_checks(result: dict) -> list[dict]:
    return [c for c in gate_section(result).get("checks") or [] if isinstance(c, dict) and not c.get("passed")]


THRESHOLD_KEYS = ("fail_under_mse", "fail_under_attack_mse", "max_advantage", "max_utility_loss")


def thresholds_set(result: dict) -> bool:
    """Whether any pass/fail threshold (or --strict) was asked for (otherwise "passed" only means "complete")."""
    gate = gate_section(result)
    thresholds = any(is_number(gate.get(key)) for key in THRESHOLD_KEYS)
    return gate.get("strict") is True or thresholds or isinstance(gate.get("baseline"), dict)


def verdict_class(result: dict) -> str:
    """pass / fail, or neutral for a complete audit that had no thresholds to meet."""
    if not gate_section(result).get("passed"):
        return "fail"
    return "pass" if thresholds_set(result) else "neutral"


def headline(result: dict) -> str:
    """The verdict in one line; a quick run says so (its attacks only bound the leakage from below)."""
    words = _verdict_headline(result)
    return words + " [QUICK RUN: lower bounds on leakage]" if section(result, "run").get("quick") else words


def _verdict_headline(result: dict) -> str:
    gate = gate_section(result)
    if not gate:
        return "NO VERDICT: the result has no gate section"
    if gate.get("passed"):
        words = (
            "PASSED: every gate check passed"
            if thresholds_set(result)
            else "AUDIT COMPLETE: no pass/fail thresholds were set; read the findings below"
        )
        inconclusive = [n for n, a in attack_entries(result).items() if outcome(a) == "inconclusive"]
        return words + (f"; INCONCLUSIVE: {text(inconclusive)} did not learn" if inconclusive else "")
    kinds = [_failure_kind(c) for c in _failed_checks(result)]
    return "FAILED: " + ("; ".join(dict.fromkeys(kinds)) or "the gate did not pass")


def verdict_text(result: dict) -> str:
    """Failed: the gate's reasons. Passed: which thresholds were met."""
    gate = gate_section(result)
    reasons = [str(r) for r in gate.get("reasons") or []]
    if not gate.get("passed"):
        return "Failed: " + ("; ".join(reasons) if reasons else "no reason given") + "."
    met = [
        f"{label} {number(gate[key])}"
        for key, label in (
            ("fail_under_mse", "provable bound MSE ≥"),
            ("fail_under_attack_mse", "best attack MSE ≥"),
            ("max_advantage", "every attack's advantage ≤"),
        )
        if is_number(gate.get(key))
    ] + (["no attack inconclusive (--strict)"] if gate.get("strict") else [])
    if not met:
        return "The audit is complete. No CI thresholds were set (see --fail-under-mse, --max-advantage)."
    return "The audit is complete and meets every threshold: " + "; ".join(met) + "."


def alert_lines(result: dict, attacks: dict[str, dict]) -> list[str]:
    """Problems a reader must not miss: failed attacks, an untrustworthy bound, a quick run."""
    alerts = [
        f"INCOMPLETE AUDIT: the {name} attack failed ({a.get('reason') or 'no reason given'}); "
        "its leakage is not measured in this report."
        for name, a in attacks.items()
        if a.get("status") == "failed"
    ]
    violated = section(result, "bounds").get("violated_by") or []
    if violated:
        causes = section(result, "bounds").get("violation_causes") or []
        alerts.append(
            f"The provable bound is not trustworthy: {text(violated)} reconstructed inputs better than "
            "it allows, so its assumptions do not hold here" + (f" ({'; '.join(causes)})." if causes else ".")
        )
    alerts += [
        f"INCONCLUSIVE: {name} did not learn ({a.get('failed_to_train') or 'no reason given'}). It measured "
        "nothing: not evidence of leakage, nor of privacy (--strict fails the gate on it)."
        for name, a in attacks.items()
        if outcome(a) == "inconclusive"
    ]
    alerts += [
        f"{name}: {a['spread_warning']}." for name, a in attacks.items() if ran_ok(a) and a.get("spread_warning")
    ]
    alerts += [
        f"NOT LIKE FOR LIKE: {c.get('message')}."
        for c in gate_section(result).get("checks") or []
        if isinstance(c, dict) and c.get("cause") == "baseline-other-inputs"
    ]
    if section(result, "run").get("quick"):
        alerts.append(QUICK_ALERT)
    return alerts


def gate_table(result: dict) -> Table | None:
    checks = [c for c in gate_section(result).get("checks") or [] if isinstance(c, dict)]
    if not checks:
        return None
    rows = [
        [
            str(c.get("name", "")),
            "passed" if c.get("passed") else "FAILED",
            number(c.get("value")),
            number(c.get("threshold")),
            str(c.get("message", "")),
        ]
        for c in checks
    ]
    return Table(
        ["check", "result", "value", "threshold", "detail"],
        rows,
        ["ok" if c.get("passed") else "failed" for c in checks],
    )
