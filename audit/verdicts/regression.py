"""The regression test against a baseline audit (no I/O): did the provable bound fall, or an attack's
leakage grow, by more than the two measurements' uncertainty allows?

A measurement moved against privacy when its change exceeds Z * sqrt(se_baseline^2 + se_current^2):
the bound (the van Trees MSE at the estimate of E[dFIL], `van_trees_mse_point`) with its standard
error (`van_trees_stderr`), an attack's advantage (the mean over its seeds) with the standard error of
that mean (advantage_std / sqrt(seeds)). An uncertainty that was not measured (one seed, no stderr
kept) counts as 0, so the test is stricter, never looser, for it; the row says so. Only attacks whose
outcome is leakage or no-advantage in both audits compare: one that did not learn (inconclusive),
failed, was skipped or is absent in either is listed as not comparable.

`baseline_summary` keeps of the baseline exactly what the test reads, so that the gate can be
recomputed from a saved report alone (reports.consistency); `compare_to_baseline` is the test, used
by the gate (verdicts.gate) and by `splitaudit compare`.
"""

from __future__ import annotations

import math

from splitaudit.core.registries import GATED_BOUND

Z = 1.96  # two measurements differ beyond noise when their difference exceeds Z combined standard errors
COMPARABLE_OUTCOMES = ("leakage", "no-advantage")


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def bound_value(result: dict) -> tuple[float | None, float | None]:
    """The gated bound at the estimate of E[dFIL] (its interval's upper end where no point is kept) and its stderr."""
    bounds = result.get("bounds") or {}
    value = _number(bounds.get(f"{GATED_BOUND.key}_point"))
    if value is None:
        value = _number(bounds.get(GATED_BOUND.key))
    return value, _number(bounds.get(GATED_BOUND.stderr_key)) if GATED_BOUND.stderr_key else None


def _attack_summary(attack: dict) -> dict:
    seeds = attack.get("seeds") or []
    std = _number(attack.get("advantage_std"))
    return {
        "status": attack.get("status"),
        "outcome": attack.get("outcome"),
        "advantage": _number(attack.get("advantage")),
        "advantage_se": std / math.sqrt(len(seeds)) if std is not None and len(seeds) > 1 else None,
    }


def baseline_summary(baseline: dict, source: str) -> dict:
    """What the regression test reads of the baseline (stored as gate.baseline in the new report)."""
    value, stderr = bound_value(baseline)
    provenance = baseline.get("provenance") or {}
    return {
        "source": source,
        "fingerprint": provenance.get("fingerprint"),
        "files": [{"role": f["role"], "sha256": f["sha256"]} for f in provenance.get("files") or []],
        "noise_sigma": _number(baseline.get("noise_sigma")),
        "bound": value,
        "bound_se": stderr,
        "attacks": {name: _attack_summary(a) for name, a in (baseline.get("attacks") or {}).items()},
    }


def input_differences(summary: dict, result: dict) -> list[str]:
    """The inputs whose digests differ between the baseline and this audit, one sentence each."""
    if not summary["files"]:
        return ["the baseline records no file digests (no provenance): whether it audited the same files is unknown"]
    before = {f["role"]: f["sha256"] for f in summary["files"]}
    after = {f["role"]: f["sha256"] for f in (result.get("provenance") or {}).get("files") or []}
    found = []
    for role in dict.fromkeys([*before, *after]):
        if before.get(role) != after.get(role):
            if role not in after:
                found.append(f"the baseline read a {role} file that this audit did not")
            elif role not in before:
                found.append(f"this audit read a {role} file that the baseline did not")
            else:
                found.append(f"the {role} file's SHA-256 differs")
    sigma = _number(result.get("noise_sigma"))
    if summary["noise_sigma"] != sigma:
        found.append(f"the noise sigma differs ({summary['noise_sigma']} in the baseline, {sigma} here)")
    return found


def _row(name: str, before: float, before_se, now: float, now_se, worse: float) -> dict:
    """One comparison: `worse` is the change against privacy (bound fell, advantage grew)."""
    known = [se for se in (before_se, now_se) if se is not None]
    allowed = Z * math.sqrt(sum(se**2 for se in known))
    uncertainty = {2: "both measured", 1: "one side measured (the other counts as 0)", 0: "none measured (0)"}
    return {
        "name": name,
        "comparable": True,
        "reason": "",
        "baseline": before,
        "baseline_se": before_se,
        "current": now,
        "current_se": now_se,
        "worse_by": worse,
        "allowed": allowed,
        "uncertainty": uncertainty[len(known)],
        "regressed": worse > allowed,
    }


def _not_comparable(name: str, reason: str) -> dict:
    return {"name": name, "comparable": False, "reason": reason, "regressed": False}


def _attack_row(name: str, before: dict | None, attack: dict | None) -> dict:
    now = _attack_summary(attack) if isinstance(attack, dict) else None
    for when, entry in (("baseline", before), ("this audit", now)):
        if entry is None:
            return _not_comparable(name, f"absent from {when}")
        if entry["status"] != "ok":
            return _not_comparable(name, f"{entry['status']} in {when}")
        if entry["outcome"] not in COMPARABLE_OUTCOMES:
            return _not_comparable(name, f"{entry['outcome'] or 'no outcome'} in {when}: it measured nothing")
        if entry["advantage"] is None or not math.isfinite(entry["advantage"]):
            return _not_comparable(name, f"no finite advantage in {when}")
    worse = now["advantage"] - before["advantage"]
    return _row(name, before["advantage"], before["advantage_se"], now["advantage"], now["advantage_se"], worse)


def compare_to_baseline(summary: dict, result: dict) -> dict:
    """The regression test of `result` against a baseline_summary: the bound's row, one row per
    attack of either audit, and the differences between the audited inputs."""
    before, before_se = summary["bound"], summary["bound_se"]
    now, now_se = bound_value(result)
    if before is None or now is None or math.isnan(before) or math.isnan(now):
        bound = _not_comparable(GATED_BOUND.name, "no bound in " + ("the baseline" if before is None else "this audit"))
    elif math.isinf(before) or math.isinf(now):
        bound = _row(GATED_BOUND.name, before, None, now, None, math.inf if now < before else 0.0)
    else:
        bound = _row(GATED_BOUND.name, before, before_se, now, now_se, before - now)
    attacks = result.get("attacks") or {}
    names = list(dict.fromkeys([*summary["attacks"], *attacks]))
    return {
        "input_differences": input_differences(summary, result),
        "bound": bound,
        "attacks": [_attack_row(n, summary["attacks"].get(n), attacks.get(n)) for n in names],
    }


def describe_row(row: dict, quantity: str) -> str:
    """A row in one sentence: the two values, the change against privacy and what the noise allows."""
    if not row["comparable"]:
        return f"{row['name']}: not comparable ({row['reason']})"
    verdict = "REGRESSED" if row["regressed"] else "within noise"
    return (
        f"{row['name']} {quantity} {row['baseline']:.4g} in the baseline, {row['current']:.4g} now: worse by "
        f"{row['worse_by']:.4g}, {verdict} (allowed {Z} x combined stderr = {row['allowed']:.4g}; "
        f"uncertainty {row['uncertainty']})"
    )
