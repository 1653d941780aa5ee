"""`splitaudit verify`: are these the files a report audited, and does its dFIL measure again?

The files are checked against the report's provenance section (splitaudit.engine.provenance): each
recorded input is hashed again, at the path given on the command line or else the recorded one
(relative paths are taken from the current folder), and the first digest that differs is named.
With recompute, the dFIL is measured again from the verified files with the recorded options and
seed, and must fall inside the report's 95% interval (widened by RECOMPUTE_RTOL for the rounding of
another machine or device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from splitaudit.core.config import AuditOptions
from splitaudit.core.errors import InputError
from splitaudit.core.registries import resolve, result_kind
from splitaudit.core.safety import display_path
from splitaudit.engine.provenance import fingerprint
from splitaudit.inputs.digests import OPTION_OF_ROLE, digest_record

RECOMPUTE_RTOL = 1e-4  # float32 Jacobian products on another CPU or a GPU agree to a few 1e-6 of the mean
OVERRIDE_ROLES = (*OPTION_OF_ROLE, "config")  # the roles a verify flag can point elsewhere


@dataclass
class FileCheck:
    """One recorded input checked again: where it was looked for, and whether its digest matches."""

    role: str
    path: Path
    recorded: str
    found: str
    kind_matches: bool

    @property
    def matches(self) -> bool:
        return self.kind_matches and self.found == self.recorded

    def describe(self) -> str:
        if self.matches:
            return f"{self.role} {display_path(self.path)}: sha256 {self.found[:16]}... matches"
        if not self.kind_matches:
            return (
                f"{self.role} {display_path(self.path)} is not the kind of input the report recorded (file or folder)"
            )
        return (
            f"{self.role} {display_path(self.path)} differs from the audited one: sha256 {self.found[:16]}..., "
            f"the report recorded {self.recorded[:16]}..."
        )


def provenance_of(report: dict, source: str) -> dict:
    """The report's provenance, checked: present, inputs all from files, fingerprint its own digests'."""
    provenance = report.get("provenance")
    if not isinstance(provenance, dict):
        raise InputError(
            f"{source} has no provenance section (written before splitaudit recorded one): rerun the audit"
        )
    if provenance["in_memory"]:
        raise InputError(
            f"{source} audited inputs given in memory ({', '.join(provenance['in_memory'])}, Python API): "
            "there is no file to verify them against"
        )
    expected = fingerprint(provenance["files"], report["tool"]["version"])
    if provenance["fingerprint"] != expected:
        raise InputError(
            f"{source}: its fingerprint {provenance['fingerprint']} is not that of its own digests ({expected}); "
            "edited or corrupted?"
        )
    return provenance


def located(record: dict, overrides: dict[str, str | None]) -> Path:
    """Where to look for a recorded input: the flag's path for its role, else the recorded path; an
    ONNX model's external data beside the model looked at, under the name its graph gives."""
    if record["role"] == "model-external-data":
        model = overrides.get("model")
        return Path(model).parent / record["location"] if model else Path(record["path"])
    return Path(overrides.get(record["role"]) or record["path"])


def check_files(provenance: dict, overrides: dict[str, str | None]) -> list[FileCheck]:
    """Every recorded input hashed again, in the report's order, stopping at the first that differs.
    A path that does not exist, or a flag for an input the report never read, is bad input (exit 2)."""
    roles = {record["role"] for record in provenance["files"]}
    extra = [role for role, path in overrides.items() if path and role not in roles]
    if extra:
        raise InputError(f"the report records no {extra[0]} input: drop --{extra[0]}")
    checks = []
    for record in provenance["files"]:
        path = located(record, overrides)
        if not path.exists():
            flag = "--model (the external data lies beside it)" if record["role"] == "model-external-data" else ""
            raise InputError(
                f"{record['role']} {display_path(path)} not found: pass --{flag or record['role']} PATH to where it is now"
            )
        found = digest_record(record["role"], path)
        check = FileCheck(record["role"], path, record["sha256"], found["sha256"], found["kind"] == record["kind"])
        checks.append(check)
        if not check.matches:
            break
    return checks


def recorded_options(provenance: dict, checks: list[FileCheck], device: str | None) -> AuditOptions:
    """The audit's options as recorded, reading the verified files, measuring only (no attack);
    validated, as a report file is input like a config file."""
    names = {f.name for f in fields(AuditOptions)}
    values = {k: v for k, v in provenance["options"].items() if k in names}
    for check in checks:
        if check.role in OPTION_OF_ROLE:
            values[OPTION_OF_ROLE[check.role]] = str(check.path)
    options = AuditOptions(**values)
    return replace(
        options, attacks=["none"], device=device or options.device, workers=1, executor="local", ray_address=None
    ).validate()


def recompute_dfil(
    report: dict, provenance: dict, checks: list[FileCheck], device: str | None
) -> list[tuple[bool, str]]:
    """The dFIL measured again at each audited point (a sweep's sigmas, each cut of a cuts.json at
    its sigma) from the verified files: per point, whether it falls inside the report's interval,
    and a line saying both."""
    options = recorded_options(provenance, checks, device)
    config = next((str(c.path) for c in checks if c.role == "config"), None)
    measured = resolve(result_kind(report).remeasure)(options, report, config)
    return [_outcome(point, again) for point, again in measured]


def measure_report_again(options: AuditOptions, report: dict, config: str | None) -> list[tuple[dict, float]]:
    """A run's mean dFIL at its sigma, measured again."""
    return _measure_points_again(options, [report], config)


def measure_sweep_again(options: AuditOptions, sweep: dict, config: str | None) -> list[tuple[dict, float]]:
    """Each of a sweep's sigmas' mean dFIL, from one measurement again."""
    return _measure_points_again(options, sweep["points"], config)


def _measure_points_again(options: AuditOptions, points: list[dict], config: str | None) -> list[tuple[dict, float]]:
    """Each audited sigma's mean dFIL from one measurement of the model (it scales as 1/sigma^2)."""
    from splitaudit.engine.pipeline import AuditEngine

    with AuditEngine.prepared(options, attacks=False, config_file=config) as engine:
        return [(point, engine.assess(point["noise_sigma"])["dfil"]["mean"]) for point in points]


def _outcome(point: dict, again: float) -> tuple[bool, str]:
    """Whether a point's dFIL measured again lies in its interval, and a line saying both."""
    stored = point["dfil"]
    low, high = interval(stored)
    ok = inside(again, low, high)
    where = f"cut {point['name']!r}: " if "name" in point else ""
    return ok, (
        f"{where}dFIL at sigma {point['noise_sigma']:g} measures {again:.6g} again, "
        f"{'inside' if ok else 'OUTSIDE'} the report's interval [{low:.6g}, {high:.6g}] (mean {stored['mean']:.6g})"
    )


def interval(dfil: dict) -> tuple[float, float]:
    """The report's 95% interval of the mean dFIL (mean +- 1.96 stderr where none is stored)."""
    if dfil.get("mean_ci"):
        low, high = dfil["mean_ci"]
        return float(low), float(high)
    mean, spread = float(dfil["mean"]), 1.96 * float(dfil.get("stderr") or 0.0)
    return mean - spread, mean + spread


def inside(value: float, low: float, high: float) -> bool:
    """value within [low, high] widened by RECOMPUTE_RTOL of its size; infinities equal to their end."""
    if math.isinf(value) or math.isinf(low) or math.isinf(high):
        return low <= value <= high
    slack = RECOMPUTE_RTOL * max(abs(low), abs(high))
    return low - slack <= value <= high + slack
