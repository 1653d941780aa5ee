"""dFIL, the Cramér-Rao and van Trees bounds, and the noise that makes a bound reach a target.

Maeng et al. (NeurIPS 2023): dFIL (Eq. 4-5), the unbiased bound (Eq. 3), Corollary 1 (Eq. 6, from the van Trees
inequality, A.3-A.4). MSE here is per dimension, E||x_hat - x||^2 / d.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from splitaudit.core.registries import Bound, resolve


def dfil(trace_sq: Tensor, d: int, sigma: float) -> Tensor:
    """dFIL(x) = ||J(x)||_F^2 / (d sigma^2) for z = f(x) + N(0, sigma^2 I) (Eq. 4-5).

    sigma = 0 (a deterministic encoder) leaks without limit: +inf wherever the Jacobian is
    non-zero, and 0 where f is locally constant (nothing to learn there), never NaN. A sigma whose
    square underflows to 0 is no noise in float arithmetic; one whose square overflows gives 0.
    """
    variance = sigma * sigma  # sigma**2 raises OverflowError above 1e154; this gives inf
    if variance > 0:
        return trace_sq / (d * variance)
    return torch.where(trace_sq > 0, torch.full_like(trace_sq, math.inf), torch.zeros_like(trace_sq))


def cramer_rao_mse(dfil_value: Tensor | float) -> Tensor | float:
    """MSE >= 1/dFIL for any unbiased attacker (Eq. 3); 1/inf = 0, 1/0 = inf."""
    if isinstance(dfil_value, Tensor):
        return dfil_value.reciprocal()
    return math.inf if dfil_value == 0 else 1.0 / dfil_value


def van_trees_mse(mean_dfil: float, prior_j_over_d: float) -> float:
    """E_pi MSE >= 1 / (E_pi[dFIL] + J(pi)/d) for any attacker with prior pi (Eq. 6)."""
    total = mean_dfil + prior_j_over_d
    return math.inf if total == 0 else 1.0 / total


def bound_mse(bound: Bound, mean_dfil: float, prior_j_over_d: float) -> float:
    """A registered bound's MSE: van Trees with the prior term, Cramér-Rao (its J/d = 0) without."""
    return van_trees_mse(mean_dfil, prior_j_over_d if bound.uses_prior else 0.0)


@dataclass(frozen=True)
class BoundInputs:
    """What a bound's numbers are computed from. dfil: the estimate of E[dFIL], dfil_stderr its
    standard error, dfil_used the upper end of its interval (what the bounds use), dfil_leakiest the
    largest per-sample dFIL; prior_j_over_d: J(pi)/d as used, prior_stderr its standard error;
    stam_limit: 1/tau^2 under smoothing tau (the smallest J any prior smoothed so can have), else None."""

    dfil: float
    dfil_stderr: float
    dfil_used: float
    dfil_leakiest: float
    prior_j_over_d: float
    prior_stderr: float
    stam_limit: float | None


def van_trees_numbers(inputs: BoundInputs) -> dict:
    """The van Trees bound's standard error (delta method) and its value with the Stam limit as the
    prior term (the bound no smoothed prior can lower further), where the input is smoothed."""
    stam = inputs.stam_limit
    return {
        "van_trees_stderr": van_trees_stderr(
            inputs.dfil, inputs.dfil_stderr, inputs.prior_j_over_d, inputs.prior_stderr
        ),
        "van_trees_stam_mse": None if stam is None else van_trees_mse(inputs.dfil_used, stam),
    }


def cramer_rao_numbers(inputs: BoundInputs) -> dict:
    """The Cramér-Rao bound of the leakiest sample: what an unbiased attacker may reach on it."""
    return {"cramer_rao_mse_leakiest": cramer_rao_mse(inputs.dfil_leakiest)}


def van_trees_stderr(mean_dfil: float, mean_dfil_stderr: float, prior_j_over_d: float, prior_stderr: float) -> float:
    """Standard error of the van Trees bound by the delta method: |d(1/s)/ds| = 1/s^2."""
    bound = van_trees_mse(mean_dfil, prior_j_over_d)
    if not math.isfinite(mean_dfil) or bound == math.inf:
        return 0.0
    return bound * (bound * math.hypot(mean_dfil_stderr, prior_stderr))  # bound**2 overflows before the product


@dataclass(frozen=True)
class Calibration:
    """The noise sigma that makes a bound equal target_mse; sigma is None when none can."""

    sigma: float | None
    feasible: bool
    reason: str


# The van Trees calibration solves for a target this much (relative) above the asked one, hundreds of
# float64 rounding units: the bound recomputed at the calibrated sigma along another order of operations
# (the audit point's) then still reaches the target, so a gate at the target passes there.
CALIBRATION_MARGIN = 1e-13


def sigma_for_van_trees(trace_over_d: float, target_mse: float, prior_j_over_d: float) -> Calibration:
    """sigma = sqrt(T / (1/t - J/d)) with T = E||J||_F^2 / d (solves Eq. 6 = t for sigma).

    Impossible when 1/t <= J/d: the prior alone lets an attacker reach an MSE below t.
    """
    if target_mse <= 0:
        return Calibration(0.0, True, "every bound is >= 0: no noise is needed")
    slack = 1.0 / (target_mse * (1 + CALIBRATION_MARGIN)) - prior_j_over_d
    if slack <= 0:
        return Calibration(
            None,
            False,
            (
                f"no noise reaches a bound of {target_mse:.4g}: the prior alone (J/d = {prior_j_over_d:.4g}) "
                f"lets an attacker reach MSE {1 / prior_j_over_d:.4g} without the embeddings"
            ),
        )
    return Calibration(math.sqrt(trace_over_d / slack), True, "sigma solves 1/(E||J||_F^2/(d sigma^2) + J/d) = target")


def solve_sigma(bound: Bound, trace_over_d: float, target_mse: float, prior_j_over_d: float) -> Calibration:
    """The noise at which `bound` reaches target_mse, by its registry entry's inverse (given the
    prior term only where the bound uses it)."""
    solve = resolve(bound.inverse)
    if bound.uses_prior:
        return solve(trace_over_d, target_mse, prior_j_over_d)
    return solve(trace_over_d, target_mse)


def sigma_for_unbiased(trace_over_d: float, target_mse: float) -> Calibration:
    """sigma = sqrt(t T): the noise at which 1/E[dFIL] = t (Eq. 3 at the mean dFIL)."""
    return Calibration(math.sqrt(target_mse * trace_over_d), True, "sigma solves E||J||_F^2/(d sigma^2) = 1/target")
