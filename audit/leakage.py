"""Fisher-information leakage of an audit: dFIL, the prior term, the bounds and noise calibration.

The wiring between the AuditContext and the pure estimators of Maeng et al. (NeurIPS 2023) (splitaudit.estimators):
it picks the samples, the smoothing and the methods, and turns the estimates into the JSON-ready
`dfil`, `prior`, `bounds` and `calibration` sections of report.json (docs/design.md sections 4 and 8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from splitaudit.context import AuditContext
from splitaudit.estimators.bounds import (
    cramer_rao_mse,
    dfil,
    sigma_for_unbiased,
    sigma_for_van_trees,
    van_trees_mse,
    van_trees_stderr,
)
from splitaudit.estimators.jacobian import TraceEstimate
from splitaudit.estimators.mean_trace import Z_95, JobRunner, MeanOptions, MeanTrace, estimate_mean_trace
from splitaudit.estimators.prior import (
    QUICK_SCORE_SETTINGS,
    PriorEstimate,
    ScoreSettings,
    estimate_prior,
    mean_variance,
    within_work_cap,
)

IMAGE_SMOOTHING = 0.25  # Maeng et al. (NeurIPS 2023), A.1: the randomized-smoothing noise that works for [0,1] images
DFIL_MAX_SAMPLES, QUICK_DFIL_MAX_SAMPLES = 2048, 256
MAX_PROBES, QUICK_MAX_PROBES = 256, 64
DFIL_RTOL = 0.02  # default target of the mean trace's relative standard error (--dfil-rtol)
LEAKIEST = 5
VIOLATION_Z = 2.0  # an attack violates the bound when it is below it by this many standard errors


@dataclass
class Measurement:
    """What the bounds are computed from: Jacobian traces on target samples and the prior term."""

    smoothing: float
    index: torch.Tensor  # target indices the traces were computed at
    mean_trace: MeanTrace
    prior: PriorEstimate
    d: int
    n_target: int
    n_candidates: int  # target samples the traces were drawn from (all, or the --dfil-samples cap)

    @property
    def traces(self) -> TraceEstimate:
        return self.mean_trace.traces

    @property
    def trace_over_d(self) -> float:
        """T = E||J||_F^2 / d: dFIL at sigma = 1, the quantity calibration scales."""
        return self.mean_trace.mean / self.d

    @property
    def trace_over_d_upper(self) -> float:
        """The upper end of T's 95% confidence interval: what a promise (bound, sigma) is made from."""
        return self.mean_trace.interval()[1] / self.d


def resolve_smoothing(ctx: AuditContext, smoothing: float | None) -> float:
    """--smoothing, else 0.25 for [0,1] images (Maeng et al., NeurIPS 2023, A.1), a quarter of the
    embedding table's spread for token inputs, and 0 for other data."""
    if smoothing is not None:
        return float(smoothing)
    if ctx.tokens is not None:
        return ctx.tokens.default_smoothing()
    return IMAGE_SMOOTHING if ctx.aux.is_image and ctx.aux.in_unit_range else 0.0


def measure(
    ctx: AuditContext,
    prior: str = "ssm",
    smoothing: float | None = None,
    dfil_rtol: float = DFIL_RTOL,
    dfil_samples: int | None = None,
    runner: JobRunner | None = None,
) -> Measurement:
    """Jacobian traces on (smoothed) target samples and J(pi_tau)/d from the aux data.

    dfil_rtol: target relative standard error of the mean trace (randomised estimates);
    dfil_samples: at most this many target samples (default 2048, 256 with --quick); runner:
    where the traces' shards run (an executor's workers; None: here)."""
    tau = resolve_smoothing(ctx, smoothing)
    candidates = _dfil_sample_index(ctx, dfil_samples)
    mean_trace = _jacobian_traces(ctx, ctx.target.x[candidates], tau, dfil_rtol, runner)
    return Measurement(
        smoothing=tau,
        index=candidates[mean_trace.index],
        mean_trace=mean_trace,
        prior=_prior(ctx, prior, tau),
        d=ctx.target.x[0].numel(),
        n_target=len(ctx.target),
        n_candidates=len(candidates),
    )


def _dfil_sample_index(ctx: AuditContext, cap: int | None = None) -> torch.Tensor:
    """All target indices, or a seeded random subset when there are more than the cap."""
    cap = cap or (QUICK_DFIL_MAX_SAMPLES if ctx.quick else DFIL_MAX_SAMPLES)
    n = len(ctx.target)
    if n <= cap:
        return torch.arange(n, device=ctx.target.x.device)
    generator = torch.Generator().manual_seed(ctx.seed)
    return torch.randperm(n, generator=generator)[:cap].sort().values.to(ctx.target.x.device)


def _jacobian_traces(
    ctx: AuditContext, x: torch.Tensor, tau: float, rtol: float, runner: JobRunner | None = None
) -> MeanTrace:
    """||J||_F^2 at x + N(0, tau^2 I) (the smoothed input the bound concerns) and its mean.

    Autograd models: exact when affordable, else Hutchinson probes to the mean's rtol
    (estimators/mean_trace.py), cross-checked at run time; black-box models central differences.
    """
    if tau > 0:
        x = x + tau * torch.randn(x.shape, generator=ctx.generator(ctx.seed), device=x.device, dtype=x.dtype)
    method = "auto" if ctx.encoder.differentiable else "finite-difference"
    options = MeanOptions(
        rtol=rtol,
        max_probes=QUICK_MAX_PROBES if ctx.quick else MAX_PROBES,
        generator=ctx.generator(ctx.seed + 1),
        runner=runner,
    )
    with ctx.progress(total=len(x), desc="dFIL", unit="sample") as bar:
        return estimate_mean_trace(ctx.encoder, x, method, options, on_samples=bar.update)


def _prior(ctx: AuditContext, method: str, tau: float) -> PriorEstimate:
    if ctx.tokens is not None and tau == 0:
        return ctx.tokens.unsmoothed_prior(method)
    settings = QUICK_SCORE_SETTINGS if ctx.quick else ScoreSettings()
    if method == "gaussian":
        return estimate_prior(ctx.aux.x, method, tau)
    epochs = within_work_cap(len(ctx.aux.x), ctx.aux.x[0].numel(), settings).max_epochs
    with ctx.progress(total=epochs, desc=f"prior ({method})", unit="epoch") as bar:
        return estimate_prior(ctx.aux.x, method, tau, seed=ctx.seed, settings=settings, on_epoch=lambda: bar.update())


# --- report sections --------------------------------------------------------------------------


def assess(
    ctx: AuditContext,
    prior: str = "ssm",
    smoothing: float | None = None,
    target_mse: float | None = None,
    dfil_rtol: float = DFIL_RTOL,
    dfil_samples: int | None = None,
) -> dict:
    """The dfil, prior, bounds and calibration sections of report.json."""
    return assess_measurement(ctx, measure(ctx, prior, smoothing, dfil_rtol, dfil_samples), target_mse)


def assess_measurement(ctx: AuditContext, m: Measurement, target_mse: float | None = None) -> dict:
    """assess() from an existing measurement at ctx.noise_sigma: the traces and the prior do not
    depend on sigma (dFIL scales as 1/sigma^2), so a sweep measures once and assesses each sigma."""
    per_sample = dfil(m.traces.values, m.d, ctx.noise_sigma)
    mean_dfil, mean_se = _mean_dfil(m, per_sample, ctx.noise_sigma)
    return {
        "dfil": _dfil_section(ctx, m, per_sample, mean_dfil, mean_se),
        "prior": _prior_section(m.prior),
        "bounds": _bounds_section(ctx, m, per_sample, mean_dfil, mean_se),
        "calibration": _calibration_section(ctx, m, target_mse),
    }


def _mean_dfil(m: Measurement, per_sample: torch.Tensor, sigma: float) -> tuple[float, float]:
    """E[dFIL] over the samples and its standard error: that of the mean trace (sampling spread
    and probe noise together, estimators/mean_trace.py), scaled by 1 / (d sigma^2).

    The mean is the mean trace's own (not re-averaged from per_sample), so the bounds and the
    calibrated sigma rest on one number: at the calibrated sigma the bound is the target exactly.
    With sigma = 0 every value is exactly inf (or 0 where f is flat): no error to report."""
    if sigma == 0:
        return float(per_sample.double().mean()), 0.0
    scale = m.d * sigma**2
    return m.mean_trace.mean / scale, m.mean_trace.stderr / scale


def _dfil_interval(mean: float, stderr: float) -> tuple[float, float]:
    """E[dFIL]'s 95% confidence interval, clipped at 0."""
    return max(0.0, mean - Z_95 * stderr), _dfil_upper(mean, stderr)


def _dfil_upper(mean: float, stderr: float) -> float:
    """The upper end of E[dFIL]'s 95% confidence interval (inf stays inf)."""
    return mean + Z_95 * stderr if math.isfinite(mean) else mean


def _dfil_section(ctx: AuditContext, m: Measurement, per_sample: torch.Tensor, mean: float, stderr: float) -> dict:
    """dFIL's distribution; stderr is that of the mean (over samples, and probes if random);
    per_sample[i] belongs to target sample target_index[i]."""
    # Ranked by ||J||_F^2, which orders dFIL for any sigma and still ranks samples at sigma = 0.
    order = torch.argsort(m.traces.values, descending=True)[:LEAKIEST]
    notes = []
    if ctx.noise_sigma == 0:
        notes.append(
            "noise sigma is 0: the encoder is deterministic, so dFIL is infinite wherever its "
            "Jacobian is non-zero and the provable bound is 0; the calibration section gives the "
            "noise sigma that reaches a target bound"
        )
    if len(m.index) < m.n_target:
        notes.append(f"dFIL computed on a seeded random subset of {len(m.index)} of the {m.n_target} target samples")
    low, high = _dfil_interval(mean, stderr)
    notes.append(
        f"mean dFIL {mean:.4g}, 95% confidence interval [{low:.4g}, {high:.4g}] (spread over samples"
        + ("" if m.traces.exact else " and probe noise")
        + "); bounds and calibration use its upper end"
    )
    if m.smoothing > 0:
        notes.append(f"evaluated at the smoothed inputs x + N(0, {m.smoothing:g}^2 I) (randomized smoothing)")
    if not m.traces.exact:
        notes.append(
            f"Jacobian norms estimated with random probes (Hutchinson; median {m.traces.products} per "
            f"sample, more on the leakiest) to a {m.mean_trace.rtol:g} relative standard error of the "
            "mean; per_sample_stderr gives each sample's standard error"
        )
    if m.traces.fd_step is not None:
        notes.append(f"black-box model: Jacobians by central finite differences (step {m.traces.fd_step:.3g})")
    if ctx.encoder.stochastic:
        notes.append(
            "the encoder is stochastic: dFIL covers only the added Gaussian noise, not the "
            "encoder's own randomness (a conservative view of its leakage)"
        )
    section = {
        "mean": mean,
        "median": float(per_sample.median()),
        "max": float(per_sample.max()),
        "min": float(per_sample.min()),
        "stderr": stderr,
        "method": m.traces.method,
        "exact": m.traces.exact,
        "products_per_sample": m.traces.products,
        "noise_sigma": ctx.noise_sigma,
        "smoothing": m.smoothing,
        "trace_over_d": m.trace_over_d,
        "n_samples": len(m.index),
        "n_target": m.n_target,
        "leakiest": [
            {"index": int(m.index[i]), "dfil": float(per_sample[i]), "jacobian_sq_norm": float(m.traces.values[i])}
            for i in order.tolist()
        ],
        "per_sample": per_sample.tolist(),
        "target_index": m.index.tolist(),
        "notes": notes,
        "mean_ci": list(_dfil_interval(mean, stderr)),
        "ci_level": 0.95,
        "mean_upper": _dfil_upper(mean, stderr),
        "rtol": m.mean_trace.rtol,
        "relative_stderr": stderr / mean if mean > 0 and math.isfinite(mean) else 0.0,
        "jacobian_products": m.mean_trace.total_products,
        "n_candidates": m.n_candidates,
        "self_check": dict(m.mean_trace.check),
    }
    if not m.traces.exact:
        section["per_sample_stderr"] = dfil(m.traces.stderr, m.d, ctx.noise_sigma).tolist()
    return section


def _prior_section(p: PriorEstimate) -> dict:
    return {
        "method": p.method,
        "smoothing": p.smoothing,
        "J_over_d": p.j_over_d,
        "J_over_d_used": p.j_over_d_used,
        "stderr": p.stderr,
        "valid": p.valid,
        "stam_limit": p.stam_limit,
        "gaussian_floor": p.gaussian_floor,
        "notes": list(p.notes),
        "details": dict(p.details),
    }


def _bounds_section(ctx: AuditContext, m: Measurement, per_sample: torch.Tensor, mean: float, stderr: float) -> dict:
    j = m.prior.j_over_d_used
    notes = []
    if m.smoothing > 0:
        notes.append(
            f"with smoothing tau = {m.smoothing:g} the bounds concern reconstructing the smoothed input "
            f"x + N(0, {m.smoothing:g}^2 I) from its embedding (Maeng et al., NeurIPS 2023, A.1); attack MSEs are "
            "measured against clean inputs"
        )
    if not m.prior.valid:
        notes.append("the prior estimate failed its sanity check (see prior.notes)")
    stam = m.prior.stam_limit if m.smoothing > 0 else None
    upper = _dfil_upper(mean, stderr)
    notes.append(
        "the bounds use the upper end of E[dFIL]'s 95% confidence interval (conservative); "
        "the *_point keys use its estimate"
    )
    return {
        "cramer_rao_mse": cramer_rao_mse(upper),
        "cramer_rao_mse_point": cramer_rao_mse(mean),
        "cramer_rao_mse_leakiest": cramer_rao_mse(float(per_sample.max())),
        "van_trees_mse": van_trees_mse(upper, j),
        "van_trees_mse_point": van_trees_mse(mean, j),
        "dfil_used": upper,
        "van_trees_stderr": van_trees_stderr(mean, stderr, j, m.prior.stderr),
        "van_trees_stam_mse": None if stam is None else van_trees_mse(upper, stam),
        "mean_guess_mse": mean_variance(ctx.aux.x)[0] + m.smoothing**2,
        "violated_by": [],
        "notes": notes,
    }


def _calibration_section(ctx: AuditContext, m: Measurement, target_mse: float | None) -> dict:
    """Noise sigmas for a target bound: --fail-under-mse, else half the mean-guess MSE."""
    source = "the --fail-under-mse threshold"
    if target_mse is None:
        target_mse = 0.5 * mean_variance(ctx.aux.x)[0]
        source = "default: half the mean-guess MSE (half the aux data's mean per-dimension variance)"
    van_trees = sigma_for_van_trees(m.trace_over_d_upper, target_mse, m.prior.j_over_d_used)
    unbiased = sigma_for_unbiased(m.trace_over_d_upper, target_mse)
    return {
        "target_mse": target_mse,
        "target_source": source,
        "bound": "van-trees",
        "sigma": van_trees.sigma,
        "feasible": van_trees.feasible,
        "reason": van_trees.reason,
        "sigma_unbiased": unbiased.sigma,
        "trace_over_d": m.trace_over_d,
        "J_over_d": m.prior.j_over_d_used,
        "smoothing": m.smoothing,
        "trace_over_d_upper": m.trace_over_d_upper,
        "sigma_point": sigma_for_van_trees(m.trace_over_d, target_mse, m.prior.j_over_d_used).sigma,
        "sigma_unbiased_point": sigma_for_unbiased(m.trace_over_d, target_mse).sigma,
        "sigma_basis": "upper end of the 95% confidence interval of E||J||_F^2 (conservative)",
    }


# --- after the attacks --------------------------------------------------------------------------


def flag_violations(result: dict) -> None:
    """List (and mark) every reconstruction attack whose MSE is below the van Trees bound by more
    than VIOLATION_Z standard errors (attack spread over seeds and the bound's own error)."""
    bounds = result["bounds"]
    bound, bound_se = bounds["van_trees_mse"], bounds.get("van_trees_stderr", 0.0)
    violated = []
    for name, attack in result.get("attacks", {}).items():
        if attack.get("status") != "ok" or attack.get("kind") != "reconstruction":
            continue
        mse = attack["metrics"]["mse"]
        spread = attack.get("metrics_std", {}).get("mse", 0.0)
        margin = VIOLATION_Z * math.hypot(spread if math.isfinite(spread) else 0.0, bound_se)
        attack["bound_check"] = {"van_trees_mse": bound, "margin": margin, "violated": mse < bound - margin}
        if mse < bound - margin:
            violated.append(name)
    bounds["violated_by"] = violated
    if violated:
        causes = violation_causes(result["prior"]["smoothing"])
        bounds["violation_causes"] = causes
        bounds.setdefault("notes", []).append(
            f"{', '.join(violated)} reconstructed below the van Trees bound: the bound's assumptions failed "
            f"({'; '.join(causes)}), so it is not a guarantee here"
        )


def violation_causes(smoothing: float) -> list[str]:
    """Why an attack can beat the van Trees bound, likeliest first."""
    causes = [
        "the prior term J may be underestimated (score matching struggles with data near a low-dimensional manifold)"
    ]
    if smoothing > 0:
        causes.insert(
            0,
            f"the bound covers inputs smoothed with noise tau = {smoothing:g} (Maeng et al., NeurIPS 2023, A.1) while "
            "the attacks reconstruct the clean inputs, so it applies only if the client smooths its inputs",
        )
    return causes


# --- splitaudit calibrate ---------------------------------------------------------------------


def calibrate(
    ctx: AuditContext,
    target_mse: float,
    prior: str = "ssm",
    smoothing: float | None = None,
    dfil_rtol: float = DFIL_RTOL,
    dfil_samples: int | None = None,
) -> dict:
    """The answer of `splitaudit calibrate --json`: the sigma for the van Trees bound (and the
    unbiased one) to reach target_mse, or why no sigma can."""
    m = measure(ctx, prior, smoothing, dfil_rtol, dfil_samples)
    answer = _calibration_section(ctx, m, target_mse)
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
        "n_samples": len(m.index),
    }


def describe_calibration(answer: dict) -> str:
    """One or two lines for people: the sigma, or why none exists."""
    where = f" (bound on the smoothed input, tau = {answer['smoothing']:g})" if answer["smoothing"] > 0 else ""
    if not answer["feasible"]:
        return (
            f"no noise sigma reaches a van Trees bound of {answer['target_mse']:.4g}: {answer['reason']}.\n"
            f"Against unbiased attackers only, sigma = {answer['sigma_unbiased']:.4g} would suffice."
        )
    return (
        f"noise sigma {answer['sigma']:.4g} makes the van Trees bound reach MSE {answer['target_mse']:.4g}"
        f"{where}, prior {answer['prior']['method']}.\n"
        f"Against unbiased attackers only (Cramér-Rao), sigma {answer['sigma_unbiased']:.4g} suffices."
    )
