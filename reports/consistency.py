"""What a saved report.json or sweep.json must satisfy beyond its schema: its verdict and its
recommendation follow from its own numbers. A crafted or corrupted file whose gate says passed
while a check failed, or whose recommendation names a sigma its point does not have, would render
as something it is not; the gate and the recommendation are recomputed here, from the document's
measurements, by the code that wrote them, and any disagreement refuses the file."""

from __future__ import annotations

import math

from splitaudit.core.errors import InputError
from splitaudit.core.registries import GATED_BOUND, resolve, result_kind
from splitaudit.verdicts.gate import evaluate_gate
from splitaudit.verdicts.recommend import recommend, sweep_gate
from splitaudit.verdicts.recommend_cut import cuts_gate, recommend_cut

RUN_THRESHOLDS = ("fail_under_mse", "fail_under_attack_mse", "max_advantage")
SWEEP_THRESHOLDS = (*RUN_THRESHOLDS, "max_utility_loss")
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError)  # a field the schema lets through


def check_consistency(document: dict, source: str, legacy: bool = False) -> None:
    """InputError naming the first place where the document contradicts its own numbers. legacy: a
    schema 5 document as stored, whose completeness check also failed on an attack that did not beat
    its baseline (its gate is checked by the rules that wrote it, before readers decide it anew)."""
    try:
        problem = resolve(result_kind(document).problem)(document, legacy)
    except MALFORMED as exc:
        problem = f"its gate cannot be recomputed from its numbers ({type(exc).__name__}: {exc})"
    if problem:
        raise InputError(f"{source} contradicts itself: {problem} (edited or corrupted? rerun the audit)")


def report_problem(report: dict, legacy: bool = False) -> str | None:
    gate = report.get("gate")
    problem = _violator_problem(report)
    if problem or not isinstance(gate, dict):
        return problem  # without a gate: rendered as "NO VERDICT"
    recomputed = (
        _with_v5_completeness(recomputed_report_gate(report), report) if legacy else recomputed_report_gate(report)
    )
    return _threshold_problem(gate, RUN_THRESHOLDS) or _gate_problem(gate, recomputed)


def _with_v5_completeness(gate: dict, report: dict) -> dict:
    """The gate with schema 5's completeness check: it failed on an attack that raised or that did not
    beat its baseline (failed_to_train)."""
    complete = not any(
        a.get("status") == "failed" or (a.get("status") == "ok" and a.get("failed_to_train"))
        for a in report.get("attacks", {}).values()
    )
    checks = [{**c, "passed": complete} if c["name"] == "audit-complete" else c for c in gate["checks"]]
    return {**gate, "checks": checks}


def _violator_problem(report: dict) -> str | None:
    """Every name in bounds.violated_by is an attack of the report that ran and measured what beats a
    bound: an MSE (the van Trees bound) or a token accuracy (the token statement's ceilings)."""
    attacks = report.get("attacks") or {}
    for name in (report.get("bounds") or {}).get("violated_by") or []:
        attack = attacks.get(name)
        metrics = attack.get("metrics") or {} if isinstance(attack, dict) and attack.get("status") == "ok" else {}
        if not any(_finite(metrics.get(key)) for key in ("mse", "token_accuracy")):
            return (
                f"bounds.violated_by names {str(name)[:60]!r}, which is no attack of it that measured an MSE "
                "or a token accuracy"
            )
    return None


def recomputed_report_gate(report: dict) -> dict:
    """The report's gate recomputed from its numbers and its stored thresholds."""
    gate = report["gate"]
    return evaluate_gate(
        report,
        **{k: gate.get(k) for k in RUN_THRESHOLDS},
        strict=gate.get("strict", False),
        baseline=gate.get("baseline"),
    )


def recomputed_sweep_gate(sweep: dict) -> dict:
    """The sweep's gate recomputed from its points and its stored thresholds."""
    gate = sweep["gate"]
    return sweep_gate(sweep, **{k: gate.get(k) for k in SWEEP_THRESHOLDS}, strict=gate.get("strict", False))


def regated(document: dict) -> dict:
    """An upgraded older document with its gate decided anew by today's rules from its own numbers and
    thresholds (schema 5 failed the gate on any attack that did not beat its baseline)."""
    if not isinstance(document.get("gate"), dict):
        return document
    return {**document, "gate": resolve(result_kind(document).gate)(document)}


def sweep_problem(sweep: dict, legacy: bool = False) -> str | None:
    """sweep.json: its points, recommendation and gate agree (`legacy` plays no part: a sweep's gate was
    never the schema 5 completeness rule)."""
    points = sweep["points"]
    if not points:
        return "it has no points (no noise sigma was audited)"
    sigmas = [p["noise_sigma"] for p in points]
    if sweep.get("noise_sigmas") is not None and sweep["noise_sigmas"] != sigmas:
        return f"noise_sigmas {sweep['noise_sigmas']} are not its points' sigmas {sigmas}"
    rec = sweep["recommendation"]
    problem = _recommendation_problem(rec, points)
    if problem:
        return problem
    again = recommend(points, rec["target_mse"], rec.get("max_utility_loss"))
    if again["point_index"] != rec["point_index"]:
        return (
            f"its recommendation (point {rec['point_index']}) is not what its points give "
            f"(point {again['point_index']}, sigma {again['noise_sigma']})"
        )
    gate = sweep["gate"]
    return _threshold_problem(gate, SWEEP_THRESHOLDS) or _gate_problem(gate, recomputed_sweep_gate(sweep))


def cuts_problem(document: dict, legacy: bool = False) -> str | None:
    """cuts.json: its recommended cut and its gate are what its cuts' numbers give (`legacy` plays no
    part: cuts came after schema 5)."""
    cuts, rec = document["cuts"], document["recommendation"]
    if not cuts:
        return "it has no cuts (no cut was audited)"
    again = recommend_cut(cuts, rec["target_mse"], rec["max_accuracy_loss"])
    for key in ("cut_index", "cut", "noise_sigma", "flops", GATED_BOUND.key, "accuracy_loss"):
        if again[key] != rec[key] and not _same(again[key], rec[key]):
            return f"recommendation.{key} {rec[key]!r} is not what its cuts give ({again[key]!r})"
    gate = document["gate"]
    return _threshold_problem(gate, RUN_THRESHOLDS) or _gate_problem(gate, recomputed_cuts_gate(document))


def recomputed_cuts_gate(document: dict) -> dict:
    """The cuts audit's gate recomputed from its recommended cut and its stored thresholds."""
    gate = document["gate"]
    return cuts_gate(document, **{k: gate.get(k) for k in RUN_THRESHOLDS}, strict=gate.get("strict", False))


def _recommendation_problem(rec: dict, points: list[dict]) -> str | None:
    """The recommended index names a point, and its sigma and bound are that point's."""
    index, sigma = rec["point_index"], rec["noise_sigma"]
    if (index is None) != (sigma is None):
        return f"recommendation.point_index {index} and recommendation.noise_sigma {sigma} disagree on whether there is one"
    if index is None:
        return None
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(points):
        return f"recommendation.point_index {index} is not the index of a point (0 to {len(points) - 1})"
    point = points[index]
    if sigma != point["noise_sigma"]:
        return f"recommendation.noise_sigma {sigma} is not its point's sigma {point['noise_sigma']}"
    if not _same(rec.get(GATED_BOUND.key), point["bounds"][GATED_BOUND.key]):
        return (
            f"recommendation.{GATED_BOUND.key} {rec.get(GATED_BOUND.key)} is not its point's bound "
            f"{point['bounds'][GATED_BOUND.key]}"
        )
    return None


def _threshold_problem(gate: dict, names: tuple[str, ...]) -> str | None:
    bad = next((n for n in names if gate.get(n) is not None and not _finite(gate[n])), None)
    return f"gate.{bad} is {gate[bad]!r}, not a finite number" if bad else None


def _gate_problem(gate: dict, recomputed: dict) -> str | None:
    """gate.passed is the conjunction of its checks, and every check the document's numbers give
    is there with the same outcome (a file may carry more checks, never fewer or flipped ones)."""
    checks = gate.get("checks") or []
    failed = [c.get("name") for c in checks if not c.get("passed")]
    if bool(gate.get("passed")) != (not failed):
        return f"gate.passed is {str(gate.get('passed')).lower()} but its failed checks are {failed or 'none'}"
    stored = {c.get("name"): c.get("passed") for c in checks}
    for check in recomputed["checks"]:
        if check["name"] not in stored:
            return f"gate check {check['name']!r} is missing"
        if bool(stored[check["name"]]) != check["passed"]:
            outcome = "passed" if check["passed"] else "failed"
            return f"gate check {check['name']!r} says the opposite of its numbers, which give: {outcome}"
    return None


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _same(a, b) -> bool:
    """Equal numbers, or both missing or not a number (nan is never equal to itself)."""
    if _finite(a) or _finite(b):
        return a == b
    return (a is None and b is None) or (isinstance(a, float) and isinstance(b, float) and str(a) == str(b))
