"""Fisher-information leakage of an audit: dFIL, the prior term, the bounds and noise calibration.

The wiring between the AuditContext and the pure estimators of Maeng et al. (NeurIPS 2023) (splitaudit.estimators):
it picks the samples, the smoothing and the methods, and turns the estimates into the JSON-ready
`dfil`, `prior`, `bounds` and `calibration` sections of report.json (docs/concepts.md).
The attacks' check against the bound is in bound_check.py, the `splitaudit calibrate` answer in
calibration.py.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from splitaudit.context.audit_context import AuditContext
from splitaudit.core.errors import InputError
from splitaudit.core.registries import BOUNDS, GATED_BOUND, PRIORS, resolve
from splitaudit.estimators.bounds import BoundInputs, bound_mse, dfil, solve_sigma
from splitaudit.estimators.jacobian import FD_MAX_RELATIVE_ERROR, FD_STEP_RATIO, TraceEstimate, concatenated
from splitaudit.estimators.mean_trace import (
    LEAKIEST,
    Z_95,
    JobRunner,
    MeanOptions,
    MeanTrace,
    TraceOverflow,
    default_method,
    estimate_mean_trace,
    summarised,
)
from splitaudit.estimators.prior import (
    QUICK_SCORE_SETTINGS,
    PriorEstimate,
    ScoreSettings,
    estimate_prior,
    finite_table_prior,
    mean_variance,
    within_work_cap,
)
from splitaudit.inputs.model_checks import naming_state_edits
from splitaudit.inputs.stochastic import naming_randomness
from splitaudit.inputs.tokens import TokenSpace, bound_mask, mask_groups

IMAGE_SMOOTHING = 0.25  # Maeng et al. (NeurIPS 2023), A.1: the randomized-smoothing noise that works for [0,1] images
DFIL_MAX_SAMPLES, QUICK_DFIL_MAX_SAMPLES = 2048, 256
MAX_PROBES, QUICK_MAX_PROBES = 256, 64
DFIL_RTOL = 0.02  # default target of the mean trace's relative standard error (--dfil-rtol)


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
    if ctx.space.kind == "tokens":
        return ctx.tokens.default_smoothing()
    return IMAGE_SMOOTHING if ctx.space.kind == "image" and ctx.space.unit_range else 0.0


def measure(
    ctx: AuditContext,
    prior: str = "ssm",
    smoothing: float | None = None,
    dfil_rtol: float = DFIL_RTOL,
    dfil_samples: int | None = None,
    runner: JobRunner | None = None,
    known_prior: PriorEstimate | None = None,
) -> Measurement:
    """Jacobian traces on (smoothed) target samples and J(pi_tau)/d from the aux data.

    dfil_rtol: target relative standard error of the mean trace (randomised estimates);
    dfil_samples: at most this many target samples (default 2048, 256 with --quick); runner:
    where the traces' shards run (an executor's workers; None: here); known_prior: the prior term
    already estimated on the same aux data, method and smoothing (the cuts of one model share it)."""
    tau = resolve_smoothing(ctx, smoothing)
    candidates = _dfil_sample_index(ctx, dfil_samples)
    # a random operator the Jacobian products cannot follow, a model editing its weights as it is
    # differentiated, derivatives too large for float32: the model's faults, named (exit 2)
    with naming_randomness(), naming_state_edits(), _naming_overflow():
        mask = None if ctx.target.mask is None else ctx.target.mask[candidates]
        mean_trace = mean_trace_per_mask_pattern(  # workers hold no mask binding: masked data runs here
            ctx.tokens,
            mask,
            _smoothed(ctx, ctx.target.x[candidates], tau),
            lambda x: _jacobian_traces(ctx, x, dfil_rtol, runner if mask is None else None),
        )
    return Measurement(
        smoothing=tau,
        index=candidates[mean_trace.index],
        mean_trace=mean_trace,
        prior=known_prior or _prior(ctx, prior, tau),
        d=ctx.target.x[0].numel(),
        n_target=len(ctx.target),
        n_candidates=len(candidates),
    )


@contextmanager
def _naming_overflow() -> Iterator[None]:
    try:
        yield
    except TraceOverflow as exc:
        raise InputError(str(exc)) from exc


def _dfil_sample_index(ctx: AuditContext, cap: int | None = None) -> torch.Tensor:
    """All target indices, or a seeded random subset when there are more than the cap."""
    cap = cap or (QUICK_DFIL_MAX_SAMPLES if ctx.quick else DFIL_MAX_SAMPLES)
    n = len(ctx.target)
    if n <= cap:
        return torch.arange(n, device=ctx.target.x.device)
    generator = torch.Generator().manual_seed(ctx.seed)
    return torch.randperm(n, generator=generator)[:cap].sort().values.to(ctx.target.x.device)


def _smoothed(ctx: AuditContext, x: torch.Tensor, tau: float) -> torch.Tensor:
    """x + N(0, tau^2 I): the smoothed input the bound concerns (seeded)."""
    if tau == 0:
        return x
    return x + tau * torch.randn(x.shape, generator=ctx.generator(ctx.seed), device=x.device, dtype=x.dtype)


def dfil_mean_options(ctx: AuditContext, rtol: float, runner: JobRunner | None = None) -> MeanOptions:
    """How the dFIL stage estimates the mean trace: to rtol, with the probe cap of a quick or full
    audit, its probes seeded from the audit's seed."""
    return MeanOptions(
        rtol=rtol,
        max_probes=QUICK_MAX_PROBES if ctx.quick else MAX_PROBES,
        generator=ctx.generator(ctx.seed + 1),
        runner=runner,
    )


def _jacobian_traces(ctx: AuditContext, x: torch.Tensor, rtol: float, runner: JobRunner | None = None) -> MeanTrace:
    """||J||_F^2 at the (smoothed) samples x and its mean.

    Autograd models: exact when affordable, else Hutchinson probes to the mean's rtol
    (estimators/mean_trace.py), cross-checked at run time; black-box models central differences.
    """
    method = default_method(ctx.encoder.differentiable)
    options = dfil_mean_options(ctx, rtol, runner)
    with ctx.progress(total=len(x), desc="dFIL", unit="sample") as bar:
        return estimate_mean_trace(ctx.encoder, x, method, options, on_samples=bar.update)


def prior_term(ctx: AuditContext, method: str, smoothing: float | None) -> PriorEstimate:
    """The prior term alone, on ctx's aux data (the cuts of one model share it: it does not depend on the model)."""
    return _prior(ctx, method, resolve_smoothing(ctx, smoothing))


def _prior(ctx: AuditContext, method: str, tau: float) -> PriorEstimate:
    if ctx.space.kind == "tokens":
        return finite_table_prior(method, tau, ctx.aux.x)
    settings = QUICK_SCORE_SETTINGS if ctx.quick else ScoreSettings()
    if not PRIORS[method].trains:
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
        "prior": prior_section(m.prior),
        "bounds": _bounds_section(ctx, m, per_sample, mean_dfil, mean_se),
        "calibration": calibration_section(ctx, m, target_mse),
    }


def _mean_dfil(m: Measurement, per_sample: torch.Tensor, sigma: float) -> tuple[float, float]:
    """E[dFIL] over the samples and its standard error: that of the mean trace (sampling spread
    and probe noise together, estimators/mean_trace.py), scaled by 1 / (d sigma^2).

    The mean is the mean trace's own (not re-averaged from per_sample), so the bounds and the
    calibrated sigma rest on one number: at the calibrated sigma the bound is the target exactly.
    With sigma = 0 (or one whose square underflows to 0, as bounds.dfil treats it) every value is
    exactly inf (or 0 where f is flat): no error to report."""
    scale = m.d * sigma * sigma  # sigma**2 raises OverflowError above 1e154; this gives inf
    if scale == 0:
        return float(per_sample.double().mean()), 0.0
    return m.mean_trace.mean / scale, m.mean_trace.stderr / scale


def _fd_error(m: Measurement, sigma: float) -> float:
    """The finite-difference error of E[dFIL] (0 with autograd, and at sigma = 0)."""
    return m.mean_trace.fd_error / (m.d * sigma**2) if sigma > 0 else 0.0


def _dfil_interval(mean: float, stderr: float, fd_error: float = 0.0) -> tuple[float, float]:
    """E[dFIL]'s 95% confidence interval widened by the finite-difference error, clipped at 0."""
    return max(0.0, mean - Z_95 * stderr - fd_error), _dfil_upper(mean, stderr, fd_error)


def _dfil_upper(mean: float, stderr: float, fd_error: float = 0.0) -> float:
    """The upper end of E[dFIL]'s 95% confidence interval plus the finite-difference error (inf stays inf)."""
    return mean + Z_95 * stderr + fd_error if math.isfinite(mean) else mean


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
    if m.mean_trace.choice:
        notes.append(f"Jacobian traces by {m.mean_trace.choice}")
    if len(m.index) < m.n_target:
        notes.append(f"dFIL computed on a seeded random subset of {len(m.index)} of the {m.n_target} target samples")
    fd_error = _fd_error(m, ctx.noise_sigma)
    low, high = _dfil_interval(mean, stderr, fd_error)
    notes.append(
        f"mean dFIL {mean:.4g}, 95% confidence interval [{low:.4g}, {high:.4g}] (spread over samples"
        + ("" if m.traces.exact or m.traces.draws > 1 else " and probe noise")
        + (" and the encoder's random draws" if ctx.encoder.stochastic else "")
        + (", widened by the finite-difference error" if m.traces.fd_step is not None else "")
        + "); bounds and calibration use its upper end"
    )
    if m.smoothing > 0:
        notes.append(f"evaluated at the smoothed inputs x + N(0, {m.smoothing:g}^2 I) (randomized smoothing)")
    if not m.traces.exact and m.traces.draws == 1:
        notes.append(
            f"Jacobian norms estimated with random probes (Hutchinson; median {m.traces.products} per "
            f"sample, more on the leakiest) to a {m.mean_trace.rtol:g} relative standard error of the "
            "mean; per_sample_stderr gives each sample's standard error"
        )
    if m.traces.fd_step is not None:
        notes.extend(_finite_difference_notes(m.mean_trace))
    if ctx.encoder.stochastic:
        notes.extend(stochastic_notes(m.traces))
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
        "mean_ci": [low, high],
        "ci_level": 0.95,
        "mean_upper": high,
        "rtol": m.mean_trace.rtol,
        "relative_stderr": stderr / mean if mean > 0 and math.isfinite(mean) else 0.0,
        "jacobian_products": m.mean_trace.total_products,
        "n_candidates": m.n_candidates,
        "self_check": dict(m.mean_trace.check),
        "approximate": m.mean_trace.approximate,
    }
    if not m.traces.exact:
        section["per_sample_stderr"] = dfil(m.traces.stderr, m.d, ctx.noise_sigma).tolist()
    if m.traces.fd_step is not None:
        section["finite_difference"] = _finite_difference_section(m.mean_trace, fd_error)
    return section


def _finite_difference_section(mt: MeanTrace, fd_error: float) -> dict:
    """The black-box estimate's steps, its measured error and whether that error is a bound."""
    choice = mt.fd_choice
    return {
        "step": mt.traces.fd_step,
        "coarse_step": FD_STEP_RATIO * mt.traces.fd_step,
        "relative_error": mt.fd_relative_error,
        "dfil_error": fd_error,
        "bounded": not mt.approximate,
        "pilot_steps": list(choice.steps) if choice else [],
        "pilot_changes": list(choice.changes) if choice else [],
    }


def _finite_difference_notes(mt: MeanTrace) -> list[str]:
    step = mt.traces.fd_step
    notes = [
        f"black-box model: Jacobians by central finite differences at the step {step:.3g}, chosen on a pilot "
        f"where it changed the trace least, and at {FD_STEP_RATIO * step:.3g} on the same directions; the two "
        f"differ by {100 * mt.fd_relative_error:.2g}% of the trace, added to both ends of the interval as the "
        "truncation error (kinks within the step bias central differences low, which would overstate the bound)"
    ]
    if mt.approximate:
        notes.append(
            "the finite-difference error could not be bounded (the estimate did not settle as the step shrank, "
            f"the two steps differ by more than {100 * FD_MAX_RELATIVE_ERROR:g}%, or independent probes at another "
            "step disagree beyond it: see self_check): the dFIL is approximate and the bound gate does not pass on it"
        )
    return notes


def stochastic_notes(traces: TraceEstimate) -> list[str]:
    """What dFIL and the bounds mean for an encoder that draws random numbers, in reviewer's words."""
    how = (
        f"the {traces.method} method ran {traces.draws} times per sample on fresh draws and was averaged"
        if traces.draws > 1
        else "each random probe saw its own draw"
    )
    return [
        "the encoder is stochastic: its Jacobian was taken with its random draws (dropout masks, internal "
        f"noise) frozen per sample and per product, and averaged over draws ({how}); this estimates "
        "E_draws ||J||_F^2 and is not exact, and the draws' spread is in the confidence interval",
        "marginalising randomness that is independent of the input cannot add Fisher information (convexity "
        "of Fisher information, data processing: Zamir, IEEE Trans. Inf. Theory 1998), so FI(z) <= "
        "E_draws[FI(z | draws)]: the dFIL reported is an upper bound on the leakage and the van Trees bound "
        "computed from it is valid and conservative (the encoder's own noise may protect more than it shows)",
        "this holds when the encoder's random draws do not depend on its input (dropout, additive noise, "
        "masks with fixed probabilities); draws whose probabilities depend on the input reveal it through "
        "which draw was taken, which the Jacobian does not see, and the bound would then not hold",
    ]


def prior_section(p: PriorEstimate) -> dict:
    """report.json's prior section of an estimate."""
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
        notes.append("the prior estimate failed its sanity check or did not converge (see prior.notes)")
    if m.mean_trace.approximate:
        notes.append("the dFIL is approximate (its finite-difference error could not be bounded): no guarantee")
    stam = m.prior.stam_limit if m.smoothing > 0 else None
    upper = _dfil_upper(mean, stderr, _fd_error(m, ctx.noise_sigma))
    notes.append(
        "the bounds use the upper end of E[dFIL]'s 95% confidence interval (conservative); "
        "the *_point keys use its estimate"
    )
    if ctx.queries > 1:
        notes.append(
            f"these bounds hold for one send of each input; an attacker averaging --queries {ctx.queries} "
            f"independent sends gains up to {ctx.queries} times the Fisher information (independent draws and "
            f"noise add up), so its {GATED_BOUND.name} bound is {bound_mse(GATED_BOUND, ctx.queries * upper, j):.4g}"
        )
    inputs = BoundInputs(mean, stderr, upper, float(per_sample.max()), j, m.prior.stderr, stam)
    return {
        **{key: bound_mse(bound, upper, j) for key, bound in BOUNDS.items()},
        **{f"{key}_point": bound_mse(bound, mean, j) for key, bound in BOUNDS.items()},
        **{
            key: value
            for bound in BOUNDS.values()
            if bound.numbers
            for key, value in resolve(bound.numbers)(inputs).items()
        },
        "dfil_used": upper,
        "mean_guess_mse": mean_variance(ctx.aux.x)[0] + m.smoothing**2,
        "violated_by": [],
        "notes": notes,
    }


def calibration_section(ctx: AuditContext, m: Measurement, target_mse: float | None) -> dict:
    """Noise sigmas for a target bound: --fail-under-mse, else half the mean-guess MSE. Each bound's
    `sigma_key` holds the sigma its registry entry's inverse solves for (`sigma`: the gated bound's,
    with `feasible` and `reason`), at the upper end of E[dFIL]'s interval and (`_point`) at its estimate."""
    source = "the --fail-under-mse threshold"
    if target_mse is None:
        target_mse = 0.5 * mean_variance(ctx.aux.x)[0]
        source = "default: half the mean-guess MSE (half the aux data's mean per-dimension variance)"
    j = m.prior.j_over_d_used
    gated = solve_sigma(GATED_BOUND, m.trace_over_d_upper, target_mse, j)
    sigmas = {
        bound.sigma_key: solve_sigma(bound, m.trace_over_d_upper, target_mse, j).sigma
        for bound in BOUNDS.values()
        if not bound.gated
    }
    at_estimate = {
        f"{bound.sigma_key}_point": solve_sigma(bound, m.trace_over_d, target_mse, j).sigma for bound in BOUNDS.values()
    }
    return {
        "target_mse": target_mse,
        "target_source": source,
        "bound": GATED_BOUND.slug,
        "sigma": gated.sigma,
        "feasible": gated.feasible,
        "reason": gated.reason,
        **sigmas,
        "trace_over_d": m.trace_over_d,
        "J_over_d": j,
        "smoothing": m.smoothing,
        "trace_over_d_upper": m.trace_over_d_upper,
        **at_estimate,
        "sigma_basis": "upper end of the 95% confidence interval of E||J||_F^2 (conservative)",
    }


def mean_trace_per_mask_pattern(
    tokens: TokenSpace | None, mask: torch.Tensor | None, x: torch.Tensor, estimate: Callable[[torch.Tensor], MeanTrace]
) -> MeanTrace:
    """estimate(x) (a mean Jacobian trace) on each group of samples sharing a mask pattern under its
    mask, merged into one over all samples: per-sample traces side by side (index into x), the
    mean and its standard error recomputed over them, products summed, the largest group's self-check."""
    groups = mask_groups(mask, len(x)) if tokens is not None and tokens.masked is not None else []
    if len(groups) <= 1:
        with bound_mask(tokens, groups[0][0] if groups else None):
            return estimate(x)
    parts = []
    for row, positions in groups:
        positions = positions.to(x.device)
        with bound_mask(tokens, row):
            parts.append((positions, estimate(x[positions])))
    merged = summarised(
        concatenated([part.traces for _, part in parts]),
        torch.cat([positions[part.index] for positions, part in parts]),
        parts[0][1].rtol,
        sum(part.total_products for _, part in parts),
    )
    largest = max(parts, key=lambda p: len(p[0]))[1]
    merged.check = largest.check
    merged.fd_choice = largest.fd_choice
    return merged
