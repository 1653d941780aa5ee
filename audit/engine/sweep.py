"""`splitaudit sweep`: the privacy-utility frontier over a grid of noise sigmas.

One prepared engine (pipeline.AuditEngine: the loaded context and one measurement, since the
Jacobian traces and the prior term do not depend on sigma) serves every audit point; the attacks at
every sigma run first, as one grid of tasks on the executor. Each point is then one call,
`engine.point(sigma, attacks)`. The recommendation and the sweep's gate (splitaudit.verdicts.recommend)
read only the points.
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Callable

from tqdm import tqdm

from splitaudit.attacks import attack_class, attack_names
from splitaudit.context.audit_context import AuditContext, silent_progress
from splitaudit.core.config import AuditOptions, sigma_key
from splitaudit.core.errors import InputError
from splitaudit.engine.pipeline import AuditEngine, describe_run
from splitaudit.engine.provenance import Invocation
from splitaudit.stages.inversion_comparison import compare_inversions
from splitaudit.verdicts.gate import thresholds_of
from splitaudit.verdicts.recommend import recommend, sweep_gate

KIND = "sweep"
AUTO_FACTORS = (0.5, 1.0, 2.0)  # around the calibrated sigma, on a log scale (each point costs every attack)
POINT_KEYS = ("noise_sigma", "dfil", "bounds", "attacks", "utility")  # a point's sections (prior: once per sweep)


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


def run_sweep(
    options: AuditOptions,
    progress: Callable[..., tqdm] = silent_progress,
    invocation: Invocation | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> dict:
    """The whole sweep: sweep.json's content (points, recommendation, gate, provenance) for validated
    `options` (AuditOptions.validate); on_notice: AuditEngine.prepared's."""
    started = datetime.now(timezone.utc)
    clock = time.perf_counter()
    if not options.noise_sigmas and not options.auto_sigma:
        raise InputError("no noise sigmas to sweep: pass --noise-sigma S1,S2,... and/or --auto-sigma")
    invocation = invocation or Invocation()
    with AuditEngine.prepared(options, progress, config_file=invocation.config_file, on_notice=on_notice) as engine:
        ctx, clean_utility = engine.ctx, engine.clean_utility
        header = describe_sweep(ctx, options, started)
        target = options.target_mse if options.target_mse is not None else options.fail_under_mse
        shared = engine.assess(0.0, target)
        calibration = shared["calibration"]
        auto = calibration["sigma"] if options.auto_sigma and calibration["feasible"] else None
        sigmas = sweep_sigmas(options.noise_sigmas or [], auto)
        if not sigmas:
            raise InputError(
                f"--auto-sigma found no sigma for the target MSE {calibration['target_mse']:.4g} "
                f"({calibration['reason']}) and no --noise-sigma was given: nothing to audit"
            )
        grid, executed = engine.run_attacks([sigma for sigma, _ in sigmas])
        points = []
        with progress(total=len(sigmas), desc="sweep", unit="sigma") as bar:
            for sigma, origin in sigmas:
                bar.set_postfix_str(f"sigma {sigma:.4g}")
                point = engine.point(sigma, grid[sigma], calibration["target_mse"])
                points.append({**{key: point[key] for key in POINT_KEYS}, "origin": origin, **inversions(point)})
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
        "target_source": target_source(options, calibration),
        "max_utility_loss": options.max_utility_loss,
        "prior": shared["prior"],
        "calibration": calibration,
        "utility_clean": clean_utility,
        "points": points,
        "provenance": engine.provenance(started, invocation),
    }
    auto_reason = calibration["reason"] if options.auto_sigma else None
    sweep = {
        **body,
        "recommendation": recommend(points, calibration["target_mse"], options.max_utility_loss, auto_reason),
    }
    gate = sweep_gate(sweep, **thresholds_of(options), max_utility_loss=options.max_utility_loss)
    return {**sweep, "gate": gate, "run": {**sweep["run"], "seconds": time.perf_counter() - clock}}


def inversions(point: dict) -> dict:
    """A token point's comparison of sequential and learned inversion ({} where either did not run)."""
    comparison = compare_inversions(point["attacks"], point["noise_sigma"])
    return {} if comparison is None else {"inversions": comparison}


def describe_sweep(ctx: AuditContext, options: AuditOptions, started: datetime) -> dict:
    """run's header without its single noise_sigma, marked as a sweep (run_sweep adds the
    executor's keys to its run section once the attacks have run)."""
    header = describe_run(ctx, options, started)
    del header["noise_sigma"]
    header["kind"] = KIND
    return header


def target_source(options: AuditOptions, calibration: dict) -> str:
    """Where a sweep's or cuts' target bound came from, in the report's words."""
    if options.target_mse is not None:
        return "the --target-mse option"
    if options.fail_under_mse is not None:
        return "the --fail-under-mse threshold"
    return calibration["target_source"]


# An attack costing more than this (Attack.relative_cost) trains for minutes at each point, most of a full
# audit's time: too slow for a demo (SDAR today; `splitaudit sweep --attacks all` runs it).
DEMO_SWEEP_MAX_COST = 10.0


def demo_sweep_options(options: AuditOptions) -> AuditOptions:
    """`demo --sweep`: the demo's model and data swept over sigma 0 and the calibrated sigma with
    the points around it, with every attack of at most DEMO_SWEEP_MAX_COST."""
    attacks = [name for name in attack_names() if attack_class(name).relative_cost <= DEMO_SWEEP_MAX_COST]
    return replace(options, noise_sigmas=[0.0], auto_sigma=True, attacks=attacks)
