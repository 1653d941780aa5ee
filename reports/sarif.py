"""The gate and bound violations as SARIF 2.1.0 (report.sarif), for GitHub code scanning.

One result per failed gate check and per attack that beat the van Trees bound, each located
at the model file. Causes and severities are read from the result (the gate and the leakage
stage decided them); nothing is re-decided here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePath
from urllib.parse import quote

from splitaudit.core.registries import GATED_BOUND
from splitaudit.reports.documents import Document
from splitaudit.reports.files import to_strict_json, write_atomic
from splitaudit.reports.formatting import number
from splitaudit.reports.view_verdict import CAUSE_WORDS, QUICK_ALERT

SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
INFORMATION_URI = "https://github.com/splitaudit/splitaudit"
LEVELS = {"error": "error", "warning": "warning", "note": "note", "none": "none"}  # severity -> SARIF level
RULES = {
    "audit-complete": "Every selected attack ran (or was skipped with a reason).",
    "fail-under-mse": f"The {GATED_BOUND.name} bound on any attacker's reconstruction MSE reaches --fail-under-mse.",
    "fail-under-attack-mse": "No reconstruction attack gets an MSE below --fail-under-attack-mse.",
    "max-advantage": "No attack's advantage over its baseline exceeds --max-advantage.",
    "strict": "Every attack learned (--strict: an inconclusive attack measured nothing).",
    "bound-violated": f"No reconstruction attack beats the {GATED_BOUND.name} bound (otherwise its assumptions failed).",
}
VIOLATION_LEVEL = "warning"  # a beaten bound is a finding; the gate makes it an error when a threshold rests on it


def sarif_log(result: dict, base: Path | None = None) -> dict:
    """The SARIF log of a result; the model path is made relative to `base` (default: cwd) when inside it."""
    location = _model_location(result["model"]["path"], base or Path.cwd())
    findings = [_gate_finding(c) for c in result["gate"]["checks"] if not c["passed"]]
    findings += [_violation_finding(name, result) for name in result["bounds"]["violated_by"]]
    rule_ids = list(dict.fromkeys(f["ruleId"] for f in findings))
    results = [
        {
            **f,
            "ruleIndex": rule_ids.index(f["ruleId"]),
            "locations": [location],
            "partialFingerprints": {"splitaudit/v1": _fingerprint(f, location)},
        }
        for f in findings
    ]
    driver = {
        "name": "splitaudit",
        "version": result["tool"]["version"],
        "informationUri": INFORMATION_URI,
        "rules": [_rule(rule_id) for rule_id in rule_ids],
    }
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {"driver": driver},
                "results": results,
                "invocations": [_invocation(result)],
                "properties": {
                    "passed": result["gate"]["passed"],
                    "noise_sigma": result["noise_sigma"],
                    "quick": _quick(result),
                },
            }
        ],
    }


def _quick(result: dict) -> bool:
    return bool((result.get("run") or {}).get("quick"))


def _invocation(result: dict) -> dict:
    """The run itself; a --quick run carries the quick-run warning, so a code-scanning view that
    shows no finding does not read as a full audit's clean result."""
    notes = [{"level": "warning", "message": {"text": QUICK_ALERT}}] if _quick(result) else []
    return {"executionSuccessful": True, "toolExecutionNotifications": notes}


def write_sarif_document(document: Document, out_dir: Path) -> Path:
    """KIND.sarif: the gate's findings of a report."""
    return write_sarif(document.data, out_dir / f"{document.kind}.sarif")


def write_sarif(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(to_strict_json(sarif_log(result)), indent=2, allow_nan=False) + "\n"
    return write_atomic(path.parent, path.name, text.encode("utf-8"))


def _rule_id(check_name: str) -> str:
    """max-advantage:decoder -> max-advantage: one rule per kind of check."""
    return check_name.split(":")[0]


def _rule(rule_id: str) -> dict:
    level = VIOLATION_LEVEL if rule_id == "bound-violated" else "error"
    return {
        "id": rule_id,
        "shortDescription": {"text": RULES.get(rule_id, rule_id)},
        "defaultConfiguration": {"level": level},
    }


def _gate_finding(check: dict) -> dict:
    words = CAUSE_WORDS.get(check["cause"], check["cause"])
    return {
        "ruleId": _rule_id(check["name"]),
        "level": LEVELS[check["severity"]],
        "message": {"text": f"{words[0].upper()}{words[1:]}: {check['message']}."},
        "properties": {
            "check": check["name"],
            "cause": check["cause"],
            "value": check["value"],
            "threshold": check["threshold"],
        },
    }


def _violation_finding(name: str, result: dict) -> dict:
    metrics = result["attacks"][name]["metrics"]
    if "mse" not in metrics:  # a token attack that beat the token statement's ceilings joins the violators too
        return _token_violation_finding(name, metrics, result.get("tokens") or {})
    bounds = result["bounds"]
    mse = metrics["mse"]
    causes = "; ".join(bounds.get("violation_causes", []))
    return {
        "ruleId": "bound-violated",
        "level": VIOLATION_LEVEL,
        "message": {
            "text": f"The {name} attack reconstructs with MSE {mse:.4g}, below the {GATED_BOUND.name} bound "
            f"{bounds[GATED_BOUND.key]:.4g}: the bound cannot be trusted here. Likely causes: "
            f"{causes}."
        },
        "properties": {"attack": name, "mse": mse, GATED_BOUND.key: bounds[GATED_BOUND.key]},
    }


def _token_violation_finding(name: str, metrics: dict, statement: dict) -> dict:
    """An attack that recovered more tokens than the token statement's ceilings allow."""
    accuracy, ceiling = metrics.get("token_accuracy"), statement.get("token_accuracy_ceiling")
    match, match_ceiling = metrics.get("exact_match"), statement.get("exact_match_ceiling")
    return {
        "ruleId": "bound-violated",
        "level": VIOLATION_LEVEL,
        "message": {
            "text": f"The {name} attack recovers tokens beyond the token statement's ceilings (token accuracy "
            f"{number(accuracy)} against at most {number(ceiling)}, exact match {number(match)} against at most "
            f"{number(match_ceiling)}): an estimate the statement rests on does not hold for these inputs."
        },
        "properties": {"attack": name, "token_accuracy": accuracy, "token_accuracy_ceiling": ceiling},
    }


def _model_location(model_path: str, base: Path) -> dict:
    """The model file as a physicalLocation: relative to the source root when it lies under `base`."""
    path = Path(model_path)
    try:
        relative = path.resolve().relative_to(base.resolve())
        artifact = {"uri": quote(PurePath(relative).as_posix()), "uriBaseId": "%SRCROOT%"}
    except ValueError:
        artifact = {"uri": path.resolve().as_uri()}
    return {"physicalLocation": {"artifactLocation": artifact, "region": {"startLine": 1}}}


def _fingerprint(finding: dict, location: dict) -> str:
    """Stable across runs for the same rule, check and model file (GitHub matches alerts by it)."""
    key = [
        finding["ruleId"],
        finding["properties"].get("check") or finding["properties"].get("attack"),
        location["physicalLocation"]["artifactLocation"]["uri"],
    ]
    return hashlib.sha256("\0".join(map(str, key)).encode()).hexdigest()[:32]
