"""`splitaudit sweep`: the privacy-utility frontier over a grid of noise sigmas.

One loaded context and one measurement (Jacobian traces and prior term: they do not depend on
sigma, and dFIL scales as 1/sigma^2) are shared by every audit point. Each point is a plain call,
`audit_point(ctx, measurement, sigma, attack_names, seed)` -> a JSON-ready dict, so the points (and
their attacks, through `run_attacks`) can be run elsewhere. The recommendation is the smallest
audited sigma whose van Trees bound (Maeng et al., NeurIPS 2023) reaches the target and that no
attack beats, with what it costs in accuracy.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Callable

import torch
from tqdm import tqdm

from splitaudit import leakage, utility
from splitaudit.attacks import ATTACK_NAMES, check_attack_inputs, check_attack_options, get_attack
from splitaudit.config import AuditOptions, sigma_key
from splitaudit.context import AuditContext, silent_progress
from splitaudit.errors import InputError
from splitaudit.gate import evaluate_gate, no_recommendation_check, utility_loss_check
from splitaudit.pipeline import (
    attack_grid,
    check_executor,
    describe_run,
    measure_leakage,
    opened_executor,
    prepare_context,
    select_attacks,
)

KIND = "sweep"
AUTO_FACTORS = (0.5, 1.0, 2.0)  # around the calibrated sigma, on a log scale (each point costs every attack)
REACHES_RTOL = 1e-9  # the calibrated sigma's bound equals the target up to rounding


def run_attacks(ctx: AuditContext, names: list[str]) -> dict:
    """Every selected attack at the context's sigma; the loop an executor can replace."""
    return {name: get_attack(name).run(ctx) for name in names}


def audit_point(
    ctx: AuditContext,
    measurement: leakage.Measurement,
    sigma: float,
    attack_names: list[str],
    seed: int,
    target_mse: float | None = None,
    clean_utility: dict | None = None,
    attacks: Callable[[AuditContext, list[str]], dict] = run_attacks,
) -> dict:
    """One audit point: dFIL and bounds from the shared measurement, every attack with its
    baseline, the bound check, and utility (its loss against clean_utility, measured if None)."""
    point_ctx = ctx.at_sigma(sigma, seed)
    sections = leakage.assess_measurement(point_ctx, measurement, target_mse)
    point = {
        "noise_sigma": sigma,
        "dfil": sections["dfil"],
        "bounds": sections["bounds"],
        "attacks": attacks(point_ctx, attack_names),
        "utility": utility.utility_section(point_ctx, clean_utility),
    }
    leakage.flag_violations({**point, "prior": sections["prior"]})  # marks point's bounds and attacks
    return point


def sweep_sigmas(grid: list[float], calibrated: float | None) -> list[tuple[float, str]]:
    """The grid plus, when a calibrated sigma is given, it and AUTO_FACTORS around it; sorted,
    each with where it came from ("grid", "calibrated" or "around-calibrated")."""
    points = {sigma_key(s): (float(s), "grid") for s in grid}
    if calibrated is not None:
        for factor in AUTO_FACTORS:
            sigma = calibrated * factor
            origin = "calibrated" if factor == 1.0 else "around-calibrated"
            if sigma_key(sigma) not in points or origin == "calibrated":
                points[sigma_key(sigma)] = (sigma, origin)
    return sorted(points.values())


def run_sweep(options: AuditOptions, progress: Callable[..., tqdm] = silent_progress) -> dict:
    """The whole sweep: sweep.json's content (points, recommendation, gate)."""
    started = datetime.now(timezone.utc)
    clock = time.perf_counter()
    options.validate()
    if not options.noise_sigmas and not options.auto_sigma:
        raise InputError("no noise sigmas to sweep: pass --noise-sigma S1,S2,... and/or --auto-sigma")
    names = select_attacks(options.attacks)
    check_attack_options(options.attack_options)
    check_executor(options)
    torch.manual_seed(options.seed)
    ctx = prepare_context(options, progress)
    check_attack_inputs(ctx, names)
    clean_utility = utility.measure_utility(ctx.at_sigma(0.0))
    sweep = describe_sweep(ctx, options, started)
    with opened_executor(options, ctx) as executor:
        measurement, shards = measure_leakage(ctx, options, executor)
        target = options.target_mse if options.target_mse is not None else options.fail_under_mse
        shared = leakage.assess_measurement(ctx.at_sigma(0.0), measurement, target)
        calibration = shared["calibration"]
        auto = calibration["sigma"] if options.auto_sigma and calibration["feasible"] else None
        sigmas = sweep_sigmas(options.noise_sigmas or [], auto)
        if not sigmas:
            raise InputError(
                f"--auto-sigma found no sigma for the target MSE {calibration['target_mse']:.4g} "
                f"({calibration['reason']}) and no --noise-sigma was given: nothing to audit"
            )
        grid = attack_grid(ctx, executor, names, [sigma for sigma, _ in sigmas], progress, sweep["run"], shards)
    points = []
    with progress(total=len(sigmas), desc="sweep", unit="sigma") as bar:
        for sigma, origin in sigmas:
            bar.set_postfix_str(f"sigma {sigma:.4g}")
            point = audit_point(
                ctx,
                measurement,
                sigma,
                names,
                options.seed,
                calibration["target_mse"],
                clean_utility,
                attacks=lambda point_ctx, _names: grid[point_ctx.noise_sigma],
            )
            points.append({**point, "origin": origin})
            bar.update()
    sweep.update(
        {
            "noise_sigmas": [p["noise_sigma"] for p in points],
            "auto_sigma": {
                "requested": options.auto_sigma,
                "sigma": auto,
                "factors": list(AUTO_FACTORS),
                "reason": calibration["reason"],
            },
            "target_mse": calibration["target_mse"],
            "target_source": _target_source(options, calibration),
            "max_utility_loss": options.max_utility_loss,
            "prior": shared["prior"],
            "calibration": calibration,
            "utility_clean": clean_utility,
            "points": points,
        }
    )
    auto_reason = calibration["reason"] if options.auto_sigma else None
    sweep["recommendation"] = recommend(points, calibration["target_mse"], options.max_utility_loss, auto_reason)
    sweep["gate"] = sweep_gate(
        sweep,
        fail_under_mse=options.fail_under_mse,
        fail_under_attack_mse=options.fail_under_attack_mse,
        max_advantage=options.max_advantage,
        max_utility_loss=options.max_utility_loss,
    )
    sweep["run"]["seconds"] = time.perf_counter() - clock
    return sweep


def describe_sweep(ctx: AuditContext, options: AuditOptions, started: datetime) -> dict:
    """run's header without its single noise_sigma, marked as a sweep (the executor's keys are
    added when the attacks have run)."""
    header = describe_run(ctx, options, started)
    del header["noise_sigma"]
    header["kind"] = KIND
    return header


def _target_source(options: AuditOptions, calibration: dict) -> str:
    if options.target_mse is not None:
        return "the --target-mse option"
    if options.fail_under_mse is not None:
        return "the --fail-under-mse threshold"
    return calibration["target_source"]


def reaches(bound, target: float) -> bool:
    """Whether a bound MSE reaches the target (up to rounding in the calibrated sigma)."""
    return isinstance(bound, (int, float)) and math.isfinite(bound) and bound >= target * (1 - REACHES_RTOL)


def recommend(
    points: list[dict], target_mse: float, max_utility_loss: float | None = None, auto_sigma_reason: str | None = None
) -> dict:
    """The smallest audited sigma whose van Trees bound reaches target_mse and that no attack
    beats, with its utility loss and whether that loss is within max_utility_loss
    (auto_sigma_reason: what --auto-sigma's calibration said, when it was asked for)."""
    safe = [p for p in points if reaches(p["bounds"]["van_trees_mse"], target_mse) and not p["bounds"]["violated_by"]]
    entry = {"target_mse": target_mse, "max_utility_loss": max_utility_loss}
    if not safe:
        return {
            **entry,
            "noise_sigma": None,
            "point_index": None,
            "van_trees_mse": None,
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
        "van_trees_mse": best["bounds"]["van_trees_mse"],
        "utility_loss": loss,
        "meets_utility": meets,
        "reason": _recommendation_words(best, target_mse, max_utility_loss, meets),
    }


def _no_safe_point(points: list[dict], target_mse: float, auto_sigma_reason: str | None) -> str:
    reaching = [p for p in points if reaches(p["bounds"]["van_trees_mse"], target_mse)]
    if reaching:
        beaten = "; ".join(f"sigma {p['noise_sigma']:.4g} by {', '.join(p['bounds']['violated_by'])}" for p in reaching)
        return (
            f"every audited sigma whose van Trees bound reaches MSE {target_mse:.4g} is beaten by an attack "
            f"({beaten}), so the bound is no guarantee there: no sigma can be recommended"
        )
    finite = [p for p in points if math.isfinite(p["bounds"]["van_trees_mse"])]
    top = max(finite, key=lambda p: p["bounds"]["van_trees_mse"]) if finite else None
    largest = f"; the largest is {top['bounds']['van_trees_mse']:.4g} at sigma {top['noise_sigma']:.4g}" if top else ""
    hint = "or use --auto-sigma" if auto_sigma_reason is None else f"--auto-sigma: {auto_sigma_reason}"
    return f"no audited sigma gives a van Trees bound of at least MSE {target_mse:.4g}{largest}: audit larger sigmas ({hint})"


def _recommendation_words(point: dict, target_mse: float, max_loss: float | None, meets: bool | None) -> str:
    sigma, bound = point["noise_sigma"], point["bounds"]["van_trees_mse"]
    checked = [n for n, a in point["attacks"].items() if a.get("kind") == "reconstruction" and a.get("status") == "ok"]
    words = (
        f"sigma {sigma:.4g} is the smallest audited noise whose van Trees bound (MSE {bound:.4g}) reaches the "
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
) -> dict:
    """The run's gates on the recommended point, the utility cap, and completeness at every point
    (from sweep.json's content alone, so that a rendered sweep.json can be checked against it)."""
    failed_anywhere = {
        f"{name} at sigma {p['noise_sigma']:.4g}": a
        for p in sweep["points"]
        for name, a in p["attacks"].items()
        if a.get("status") == "failed"
    }
    checks = evaluate_gate({"attacks": failed_anywhere})["checks"]
    rec = sweep["recommendation"]
    thresholds = {
        "fail_under_mse": fail_under_mse,
        "fail_under_attack_mse": fail_under_attack_mse,
        "max_advantage": max_advantage,
    }
    if rec["noise_sigma"] is not None:
        at_rec = evaluate_gate(sweep["points"][rec["point_index"]], **thresholds)["checks"]
        checks += [c for c in at_rec if c["name"] != "audit-complete"]
    elif any(v is not None for v in thresholds.values()) or max_utility_loss is not None:
        checks.append(no_recommendation_check(rec["reason"], rec["target_mse"]))
    if max_utility_loss is not None and rec["noise_sigma"] is not None:
        checks.append(utility_loss_check(rec["utility_loss"], max_utility_loss, rec["noise_sigma"]))
    failed = [c for c in checks if not c["passed"]]
    return {
        **thresholds,
        "max_utility_loss": max_utility_loss,
        "passed": not failed,
        "reasons": [c["message"] for c in failed],
        "checks": checks,
    }


DEMO_SWEEP_SKIPS = ("sdar",)  # trains for minutes per point (most of a full audit's time): too slow for a demo


def demo_sweep_options(options: AuditOptions) -> AuditOptions:
    """`demo --sweep`: the demo's model and data swept over sigma 0 and the calibrated sigma with
    the points around it, with every attack but SDAR (`splitaudit sweep --attacks all` runs it)."""
    attacks = [name for name in ATTACK_NAMES if name not in DEMO_SWEEP_SKIPS]
    return replace(options, noise_sigmas=[0.0], auto_sigma=True, attacks=attacks).validate()
