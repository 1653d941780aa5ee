"""`splitaudit sweep`: the privacy-utility frontier over a grid of noise sigmas.

One loaded context and one measurement (Jacobian traces and prior term: they do not depend on
sigma, and dFIL scales as 1/sigma^2) are shared by every audit point; the attacks at every sigma
run first, as one grid of tasks on the executor. Each point is then a plain call,
`audit_point(ctx, measurement, sigma, attacks, seed)` -> a JSON-ready dict. The recommendation and
the sweep's gate (splitaudit.recommend) read only the points.
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Callable

from tqdm import tqdm

from splitaudit import leakage, utility
from splitaudit.attacks import ATTACK_NAMES
from splitaudit.config import AuditOptions, sigma_key
from splitaudit.context import AuditContext, silent_progress
from splitaudit.errors import InputError
from splitaudit.pipeline import (
    attack_grid,
    describe_run,
    measure_leakage,
    opened_executor,
    prepare_audit,
)
from splitaudit.recommend import recommend, sweep_gate

KIND = "sweep"
AUTO_FACTORS = (0.5, 1.0, 2.0)  # around the calibrated sigma, on a log scale (each point costs every attack)


def audit_point(
    ctx: AuditContext,
    measurement: leakage.Measurement,
    sigma: float,
    attacks: dict[str, dict],
    seed: int,
    target_mse: float | None = None,
    clean_utility: dict | None = None,
) -> dict:
    """One audit point: dFIL and bounds from the shared measurement, the attacks' entries at this
    sigma checked against the bound, and utility (its loss against clean_utility, measured if None)."""
    point_ctx = ctx.at_sigma(sigma, seed)
    sections = leakage.assess_measurement(point_ctx, measurement, target_mse)
    checked, bounds = leakage.check_against_bound(sections["bounds"], attacks, sections["prior"]["smoothing"])
    return {
        "noise_sigma": sigma,
        "dfil": sections["dfil"],
        "bounds": bounds,
        "attacks": checked,
        "utility": utility.utility_section(point_ctx, clean_utility),
    }


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
    options.validate()  # before the sigma check below, whose message assumes valid options
    if not options.noise_sigmas and not options.auto_sigma:
        raise InputError("no noise sigmas to sweep: pass --noise-sigma S1,S2,... and/or --auto-sigma")
    ctx, names = prepare_audit(options, progress)
    clean_utility = utility.measure_utility(ctx.at_sigma(0.0))
    header = describe_sweep(ctx, options, started)
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
        grid, executed = attack_grid(ctx, executor, names, [sigma for sigma, _ in sigmas], progress, shards)
    points = []
    with progress(total=len(sigmas), desc="sweep", unit="sigma") as bar:
        for sigma, origin in sigmas:
            bar.set_postfix_str(f"sigma {sigma:.4g}")
            point = audit_point(
                ctx, measurement, sigma, grid[sigma], options.seed, calibration["target_mse"], clean_utility
            )
            points.append({**point, "origin": origin})
            bar.update()
    body = {
        **header,
        "run": {**header["run"], **executed},
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
    auto_reason = calibration["reason"] if options.auto_sigma else None
    sweep = {
        **body,
        "recommendation": recommend(points, calibration["target_mse"], options.max_utility_loss, auto_reason),
    }
    gate = sweep_gate(
        sweep,
        fail_under_mse=options.fail_under_mse,
        fail_under_attack_mse=options.fail_under_attack_mse,
        max_advantage=options.max_advantage,
        max_utility_loss=options.max_utility_loss,
    )
    return {**sweep, "gate": gate, "run": {**sweep["run"], "seconds": time.perf_counter() - clock}}


def describe_sweep(ctx: AuditContext, options: AuditOptions, started: datetime) -> dict:
    """run's header without its single noise_sigma, marked as a sweep (run_sweep adds the
    executor's keys to its run section once the attacks have run)."""
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


DEMO_SWEEP_SKIPS = ("sdar",)  # trains for minutes per point (most of a full audit's time): too slow for a demo


def demo_sweep_options(options: AuditOptions) -> AuditOptions:
    """`demo --sweep`: the demo's model and data swept over sigma 0 and the calibrated sigma with
    the points around it, with every attack but SDAR (`splitaudit sweep --attacks all` runs it)."""
    attacks = [name for name in ATTACK_NAMES if name not in DEMO_SWEEP_SKIPS]
    return replace(options, noise_sigmas=[0.0], auto_sigma=True, attacks=attacks).validate()
