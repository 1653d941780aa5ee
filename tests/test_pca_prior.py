"""The optimisation attack's probabilistic PCA prior (attacks/optimization.py `fit_pca_prior`) and the
step pilot's leave-out of its own samples."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from test_reconstruction_attacks import linear_context

from splitaudit.attacks import optimization
from splitaudit.attacks.optimization import (
    PILOT_TARGETS,
    VARIANCE_FLOOR,
    OptimizationOptions,
    _held_out_log_likelihood,
    fit_prior,
    invert,
    map_weight,
    pilot_count,
    plan_inversion,
    prior_fit_seconds,
)
from splitaudit.core.threads import threads_for
from splitaudit.stages import cost

D, RANK, OUT, SIGMA, RESIDUAL_STD = 24, 3, 8, 0.3, 0.2


def low_rank_gaussian(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n samples of x ~ N(mu, B B^T + RESIDUAL_STD^2 I) in D dimensions, B of rank RANK with rows of unit
    norm (every pixel has the same variance, so the prior's per-pixel standardisation keeps the model
    exact), and that covariance."""
    rng = np.random.default_rng(seed)
    basis = rng.normal(size=(D, RANK))
    basis /= np.linalg.norm(basis, axis=1, keepdims=True)
    x = rng.normal(size=D) + rng.normal(size=(n, RANK)) @ basis.T + RESIDUAL_STD * rng.normal(size=(n, D))
    return x, basis @ basis.T + RESIDUAL_STD**2 * np.eye(D)


def expected_mse(gain: np.ndarray, a: np.ndarray, covariance: np.ndarray) -> float:
    """E ||x - mu - K (z - A mu - b)||^2 / D for z = A x + b + N(0, SIGMA^2 I): the population MSE per
    dimension of the linear estimator with gain K."""
    error = np.eye(D) - gain @ a
    return float(np.trace(error @ covariance @ error.T) + SIGMA**2 * np.trace(gain @ gain.T)) / D


def posterior_gain(a: np.ndarray, covariance: np.ndarray) -> np.ndarray:
    """The MAP / posterior mean's gain under the prior N(mu, covariance): V A^T (A V A^T + SIGMA^2 I)^-1."""
    return covariance @ a.T @ np.linalg.inv(a @ covariance @ a.T + SIGMA**2 * np.eye(len(a)))


def dense_covariance(prior: optimization.PcaPrior) -> torch.Tensor:
    """S (U diag(variances) U^T + residual (I - U U^T)) S, the d x d matrix the prior never forms."""
    u, scale = prior.directions.double(), torch.diag(prior.scale.double())
    inner = u @ torch.diag(prior.variances.double()) @ u.T + prior.residual * (torch.eye(len(u)) - u @ u.T)
    return scale @ inner @ scale


def test_map_with_the_pca_prior_reaches_the_lmmse_error_where_the_diagonal_prior_cannot():
    """f(x) = A x + b maps 24 dimensions to 8 (a 16-dimensional null space), x Gaussian of rank 3 plus
    isotropic noise, z = f(x) + N(0, sigma^2 I). MAP at weight sigma^2 under the true prior is the LMMSE
    estimator; with the PCA prior fitted on 400 aux samples it must come within 10% of the LMMSE's
    population MSE (0.152; measured 0.154 on 400 targets, whose mean has a standard error of 4% of it;
    400 samples estimate a rank-3 covariance to a few per cent), and beat the diagonal prior's
    population MSE (0.61: a diagonal prior cannot fill the null space from the seen directions) and the
    mean guess (1.04)."""
    x, covariance = low_rank_gaussian(800)
    aux, target = torch.from_numpy(x[:400]).float(), torch.from_numpy(x[400:]).float()
    torch.manual_seed(0)
    encoder = torch.nn.Linear(D, OUT).requires_grad_(False)
    z = encoder(target) + SIGMA * torch.randn(len(target), OUT, generator=torch.Generator().manual_seed(1))
    a = encoder.weight.double().numpy()
    lmmse = expected_mse(posterior_gain(a, covariance), a, covariance)
    diagonal = expected_mse(posterior_gain(a, np.diag(np.diag(covariance))), a, covariance)
    mean_guess = float(np.trace(covariance)) / D
    assert lmmse < 0.3 * diagonal and diagonal < mean_guess  # the case separates the three

    prior = fit_prior(aux, "pca", unit_range=False)
    assert prior.rank == RANK  # the held-out likelihood finds the true rank
    weights = torch.full((len(z),), SIGMA**2)
    with threads_for(aux.numel()):  # one thread, as the attack runs it: tiny ops on busy cores
        x_map = invert(encoder, z, aux, prior, weights, 600, 0.05, unit_range=False).detach()
    mse = float((x_map - target).pow(2).mean())
    assert mse == pytest.approx(lmmse, rel=0.1)
    assert mse < 0.5 * diagonal

    # the optimiser reached the fitted prior's own posterior mean, computed in closed form
    mu = aux.double().mean(0)
    gain = torch.from_numpy(posterior_gain(a, dense_covariance(prior).numpy()))
    closed_form = mu + (z.double() - mu @ torch.from_numpy(a).T - encoder.bias.double()) @ gain.T
    assert torch.allclose(x_map.double(), closed_form, atol=2e-3)


def test_the_woodbury_form_is_the_dense_gaussian_and_is_deterministic():
    """-log pi(x) in O(d k) against 0.5 (x - mu)^T C^-1 (x - mu) with C formed and inverted densely."""
    x = torch.from_numpy(low_rank_gaussian(60, seed=1)[0]).float()
    prior = fit_prior(x[:50], "pca", unit_range=False)
    assert 0 < prior.directions.shape[1] < D
    again = fit_prior(x[:50], "pca", unit_range=False)
    assert torch.equal(prior.directions, again.directions) and prior.residual == again.residual
    centred = (x[50:] - prior.mean).double()
    dense = 0.5 * (centred @ torch.linalg.inv(dense_covariance(prior)) * centred).sum(1)
    assert torch.allclose(prior(x[50:]).double(), dense, rtol=1e-4)


def test_the_held_out_likelihood_of_every_rank_is_the_dense_gaussian_log_density():
    """_held_out_log_likelihood scores every rank k at once from cumulative sums; each must equal the
    log density of the held-out samples under the rank-k prior fitted to the training part, formed
    densely (up to the same constant -d/2 log 2 pi per sample)."""
    x = torch.from_numpy(low_rank_gaussian(40, seed=2)[0])
    train, held = x[:30], x[30:]
    scores = _held_out_log_likelihood(train, held, VARIANCE_FLOOR)
    assert len(scores) == min(len(train) - 1, D - 1) + 1  # ranks 0 .. r
    mean, scale, directions, variances, residuals = optimization._ppca_spectrum(train, VARIANCE_FLOOR)
    for k in (0, 1, RANK, 10, len(scores) - 1):
        prior = optimization.PcaPrior(mean, scale, directions[:, :k], variances[:k], float(residuals[k]))
        gaussian = torch.distributions.MultivariateNormal(mean, dense_covariance(prior))
        density = gaussian.log_prob(held).sum() + len(held) * D / 2 * np.log(2 * np.pi)
        assert float(scores[k]) == pytest.approx(float(density), rel=1e-9, abs=1e-6)


def test_the_pilot_fits_its_prior_without_the_samples_it_inverts_once_per_context(tmp_path, monkeypatch):
    """The pilot inverts the first pilot_count aux samples; the prior and starting point it uses must
    come from the other aux samples only (a PCA prior spanning the pilot samples would flatter the
    pilot), while the attack's own inversion uses all aux. Each prior is fitted once per aux data:
    planning twice and running a seed twice fit two priors in all. Run twice: the plan is deterministic."""
    x, _ = low_rank_gaussian(40)
    ctx, _ = linear_context(tmp_path, x, out_features=OUT, noise_sigma=SIGMA)
    seen = []
    monkeypatch.setattr(optimization, "fit_prior", lambda aux_x, *args: seen.append(aux_x) or fit_prior(aux_x, *args))
    pilots = pilot_count(len(ctx.aux))
    assert pilots == PILOT_TARGETS == 8 and pilot_count(5) == 2
    weight = map_weight(ctx)
    opts = OptimizationOptions(steps=30, init="mean")
    plans = [plan_inversion(ctx, 0, ctx.generator(0), opts, weight, None).details() for _ in range(2)]
    assert plans[0] == plans[1]
    assert len(seen) == 1 and torch.equal(seen[0], ctx.aux.x[pilots:])
    attack = optimization.OptimizationAttack()
    results = [attack.run_seed(ctx, 0) for _ in range(2)]
    assert results[0].metrics == results[1].metrics
    assert results[0].details["prior"] == "pca" and results[0].details["prior_rank"] > 0
    assert len(seen) == 2 and torch.equal(seen[1], ctx.aux.x)


def test_independent_pixels_get_rank_zero_which_is_the_diagonal_prior():
    """Pixels drawn independently (with different spreads) have no correlations worth a direction: the
    held-out likelihood keeps k = 0, and the PCA prior is then the diagonal Gaussian exactly (the
    residual variance of the standardised pixels is their mean variance, 1)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(400, 12, generator=gen) * torch.linspace(0.5, 2.0, 12) + 5  # above the variance floor
    pca, diagonal = fit_prior(x, "pca", unit_range=False), fit_prior(x, "gaussian", unit_range=False)
    assert pca.rank == 0 and pca.residual == pytest.approx(1.0, rel=1e-6)
    probe = torch.randn(7, 12, generator=gen) + 5
    assert torch.allclose(pca(probe), diagonal(probe), rtol=1e-5)


def test_the_cost_estimate_of_a_pca_fit_is_within_2x_of_a_measured_one():
    """estimated_seconds counts the prior's fits from one timed spectrum of aux; a fit measured here (the
    least of two, in CPU seconds over torch's threads as the estimate's timer counts them) must lie
    within 2x of it. The diagonal prior's fit is a pass over aux and counts nothing."""
    x = torch.rand(300, 2, 64, 64, generator=torch.Generator().manual_seed(4))
    estimate = prior_fit_seconds(x, "pca", cost.StepTimer(cpu_bound=True))
    measured = []
    for _ in range(2):
        start = time.process_time()
        fit_prior(x, "pca", unit_range=True)
        measured.append((time.process_time() - start) / torch.get_num_threads())
    assert 0.5 < min(measured) / estimate < 2
    assert prior_fit_seconds(x, "gaussian", cost.StepTimer(cpu_bound=True)) == 0.0


def test_repeated_aux_samples_leave_no_rounding_directions():
    """Aux of 10 distinct samples, each 8 times: the centred data have rank 9, and the eigenvalues past
    it are rounding whose vectors are not orthonormal; the spectrum keeps 9 orthonormal directions and
    the prior stays finite and equal to its dense form."""
    distinct = torch.from_numpy(low_rank_gaussian(10, seed=5)[0])
    x = distinct.repeat(8, 1)
    _, _, directions, variances, residuals = optimization._ppca_spectrum(x, VARIANCE_FLOOR)
    assert directions.shape == (D, 9) and len(residuals) == 10
    assert torch.allclose(directions.T @ directions, torch.eye(9, dtype=directions.dtype), atol=1e-8)
    prior = fit_prior(x.float(), "pca", unit_range=False)
    probe = torch.from_numpy(low_rank_gaussian(3, seed=6)[0]).float()
    centred = (probe - prior.mean).double()
    dense = 0.5 * (centred @ torch.linalg.inv(dense_covariance(prior)) * centred).sum(1)
    assert torch.isfinite(prior(probe)).all() and torch.allclose(prior(probe).double(), dense, rtol=1e-4)
