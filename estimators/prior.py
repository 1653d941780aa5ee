"""The prior term J(pi)/d of the van Trees bound (paper 004, Corollary 1, Section 3.2, A.1).

J(pi) = E_pi ||grad_x log pi(x)||^2 is the Fisher information of the input distribution. It is
estimated from the attacker's auxiliary data:
- "gaussian": an isotropic Gaussian fit, J/d = 1/(mean per-dimension variance);
- "ssm": sliced score matching with variance reduction (Song et al. 2019), J = mean ||s(x)||^2
  of the learned score s on held-out samples;
- "dsm": denoising score matching, whose minimiser is the score of the noise-smoothed prior.
Randomized smoothing (A.1) replaces pi by pi_tau, the law of x + N(0, tau^2 I); the bound then
concerns the smoothed input. Two facts check every estimate:
- Stam's inequality: J(pi_tau)/d <= J(N(0, tau^2 I))/d = 1/tau^2;
- the Gaussian floor: J/d >= 1/(mean per-dimension variance), equality only for an isotropic
  Gaussian (Cramér-Rao for the location family).
An estimate above the Stam limit, or below the floor beyond its statistical error, is reported
as failed, and the bound uses the violated limit instead.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch import Tensor

from splitaudit.threads import threads_for

PRIOR_METHODS = ("ssm", "dsm", "gaussian")
DSM_NOISE_FRACTION = 0.1  # dsm without smoothing: noise level as a fraction of the data's std
FLOOR_SLACK_STDERRS = 3.0  # an estimate this many standard errors below the Gaussian floor fails


@dataclass(frozen=True)
class ScoreSettings:
    """Training budget of the score network (early stopping on the held-out loss).

    The defaults fit the digits sample (1x8x8) in a few seconds on two CPU cores; the estimate
    there moves by under 3% between 60 and 200 epochs.
    """

    max_epochs: int = 80
    patience: int = 15
    batch_size: int = 128
    lr: float = 1e-2
    max_samples: int = 2048
    heldout_fraction: float = 0.2
    eval_draws: int = 8  # smoothing draws per held-out sample when estimating J


QUICK_SCORE_SETTINGS = ScoreSettings(max_epochs=20, patience=5, max_samples=512, eval_draws=4)


@dataclass
class PriorEstimate:
    """J/d as estimated (j_over_d) and as used by the bound (j_over_d_used), with its checks."""

    method: str
    smoothing: float
    j_over_d: float
    stderr: float
    gaussian_floor: float
    stam_limit: float | None
    valid: bool = True
    j_over_d_used: float = math.nan
    notes: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)


def estimate_prior(x: Tensor, method: str, smoothing: float, seed: int = 0,
                   settings: ScoreSettings = ScoreSettings(),
                   on_epoch: Callable[[], None] | None = None) -> PriorEstimate:
    """J(pi_tau)/d from samples x of pi (tau = smoothing), checked against its limits."""
    if method == "gaussian":
        return checked(gaussian_prior(x, smoothing))
    if method in ("ssm", "dsm"):
        return checked(score_matching_prior(x, method, smoothing, seed, settings, on_epoch))
    raise ValueError(f"unknown prior method {method!r}; choose {', '.join(PRIOR_METHODS)}")


def mean_variance(x: Tensor) -> tuple[float, float]:
    """Mean per-dimension variance of x and its standard error (over samples)."""
    flat = x.flatten(1).double()
    spread = (flat - flat.mean(0)).pow(2).mean(1) * len(flat) / max(1, len(flat) - 1)
    return float(spread.mean()), float(spread.std() / math.sqrt(len(flat))) if len(flat) > 1 else 0.0


def gaussian_prior(x: Tensor, smoothing: float) -> PriorEstimate:
    """Isotropic Gaussian fit: J/d = 1/(v + tau^2), v the mean per-dimension variance."""
    variance, variance_se = mean_variance(x)
    total = variance + smoothing**2
    j = 1.0 / total if total > 0 else math.inf
    return PriorEstimate(method="gaussian", smoothing=smoothing, j_over_d=j,
                         stderr=variance_se / total**2 if total > 0 else 0.0,
                         gaussian_floor=j, stam_limit=stam_limit(smoothing))


def stam_limit(noise: float) -> float | None:
    """Stam's inequality: J(pi * N(0, noise^2 I))/d <= 1/noise^2 for every pi."""
    return 1.0 / noise**2 if noise > 0 else None


def checked(estimate: PriorEstimate) -> PriorEstimate:
    """Flag an estimate above the Stam limit or clearly below the Gaussian floor; the bound then
    uses that limit (the Stam limit holds for every smoothed prior, so that bound stays valid)."""
    j, floor, limit = estimate.j_over_d, estimate.gaussian_floor, estimate.stam_limit
    estimate.j_over_d_used = j
    if not math.isfinite(j):
        estimate.valid = False
        estimate.notes.append("the estimate is not finite: score matching failed")
        estimate.j_over_d_used = limit if limit is not None else math.inf
    elif limit is not None and j > limit:
        estimate.valid = False
        estimate.j_over_d_used = limit
        estimate.notes.append(
            f"failed estimate: J/d = {j:.4g} exceeds Stam's limit 1/tau^2 = {limit:.4g}, which holds for "
            "every prior smoothed with this tau; the bound uses the limit instead (valid, possibly loose)")
    elif j + FLOOR_SLACK_STDERRS * estimate.stderr < floor * (1 - 1e-9):
        estimate.valid = False
        estimate.j_over_d_used = floor
        estimate.notes.append(
            f"failed estimate: J/d = {j:.4g} is below the Gaussian floor 1/variance = {floor:.4g}, which "
            "every prior reaches; the bound uses the floor instead (it may still be too optimistic)"
            + ("" if estimate.smoothing > 0 else "; score matching is unreliable on data with bounded or "
               "low-dimensional support: randomized smoothing (--smoothing) stabilises it (paper 004, A.1)"))
    return estimate


# --- score matching ---------------------------------------------------------------------------

def score_matching_prior(x: Tensor, method: str, smoothing: float, seed: int,
                         settings: ScoreSettings, on_epoch: Callable[[], None] | None = None) -> PriorEstimate:
    """Train a score network by SSM-VR or DSM on (smoothed) x; J = mean ||s||^2 on held-out data."""
    variance, _ = mean_variance(x)
    noise = smoothing
    notes = []
    if method == "dsm" and noise == 0:
        noise = DSM_NOISE_FRACTION * math.sqrt(variance)
        notes.append(f"dsm needs a noise level: it estimates the prior smoothed by N(0, {noise:.3g}^2) "
                     "(no --smoothing given), which slightly underestimates J")
    generator = torch.Generator(device=x.device).manual_seed(seed)
    train, heldout = _split(x, settings, generator)
    loss = _ssm_vr_loss if method == "ssm" else _dsm_loss
    with threads_for(x.numel(), x.device):
        net, info = train_score_net(train, heldout, loss, noise, settings, generator, seed, on_epoch)
        j, se = _score_energy(net, heldout, noise, settings.eval_draws, generator)
    d = x[0].numel()
    return PriorEstimate(method=method, smoothing=smoothing, j_over_d=j / d, stderr=se / d,
                         gaussian_floor=1.0 / (variance + noise**2), stam_limit=stam_limit(noise),
                         notes=notes, details={**info, "noise": noise, "n_train": len(train),
                                               "n_heldout": len(heldout)})


def _split(x: Tensor, settings: ScoreSettings, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Seeded subsample (at most max_samples) split into training and held-out parts."""
    perm = torch.randperm(len(x), generator=generator, device=x.device)[: settings.max_samples]
    n_heldout = max(1, int(round(settings.heldout_fraction * len(perm))))
    if len(perm) - n_heldout < 1:
        raise ValueError(f"score matching needs at least 2 samples, got {len(x)}")
    return x[perm[n_heldout:]], x[perm[:n_heldout]]


def train_score_net(train: Tensor, heldout: Tensor, loss_fn, noise: float, settings: ScoreSettings,
                    generator: torch.Generator, seed: int,
                    on_epoch: Callable[[], None] | None = None) -> tuple[nn.Module, dict]:
    """Adam on the score-matching loss, stopped when the held-out loss stops improving."""
    net = make_score_net(train, noise, seed)
    optimizer = torch.optim.Adam(net.parameters(), lr=settings.lr)
    heldout_draws = _draws(heldout, generator)  # fixed, so that held-out losses are comparable
    best, best_state, since_best, epochs = math.inf, copy.deepcopy(net.state_dict()), 0, 0
    for epochs in range(1, settings.max_epochs + 1):
        for batch in train[torch.randperm(len(train), generator=generator, device=train.device)].split(settings.batch_size):
            optimizer.zero_grad()
            loss_fn(net, batch, noise, _draws(batch, generator)).backward()
            optimizer.step()
        current = float(loss_fn(net, heldout, noise, heldout_draws).detach())
        if on_epoch is not None:
            on_epoch()
        if current < best:
            best, best_state, since_best = current, copy.deepcopy(net.state_dict()), 0
        else:
            since_best += 1
            if since_best >= settings.patience:
                break
    net.load_state_dict(best_state)
    return net.eval(), {"epochs": epochs, "heldout_loss": best}


def _draws(x: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(Gaussian smoothing noise, Rademacher projection) for one pass over x."""
    eps = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    bits = torch.randint(0, 2, x.shape, generator=generator, device=x.device)
    return eps, (2 * bits - 1).to(x.dtype)


def _ssm_vr_loss(net: nn.Module, x: Tensor, noise: float, draws: tuple[Tensor, Tensor]) -> Tensor:
    """SSM-VR: E[v^T grad_x(v^T s(x)) + 1/2 ||s(x)||^2] at x ~ pi_tau (Song et al. 2019, Eq. 8)."""
    eps, v = draws
    point = (x + noise * eps).requires_grad_(True)
    score = net(point)
    grad_vs = torch.autograd.grad((score * v).sum(), point, create_graph=True)[0]
    return ((grad_vs * v).flatten(1).sum(1) + 0.5 * score.pow(2).flatten(1).sum(1)).mean()


def _dsm_loss(net: nn.Module, x: Tensor, noise: float, draws: tuple[Tensor, Tensor]) -> Tensor:
    """DSM: E||s(x~) + (x~ - x)/tau^2||^2 with x~ = x + tau eps; minimised by the score of pi_tau."""
    eps, _ = draws
    return (net(x + noise * eps) + eps / noise).pow(2).flatten(1).sum(1).mean()


@torch.no_grad()
def _score_energy(net: nn.Module, heldout: Tensor, noise: float, draws: int,
                  generator: torch.Generator) -> tuple[float, float]:
    """J_hat = mean ||s(x~)||^2 over held-out x~ ~ pi_tau, and its standard error."""
    repeats = draws if noise > 0 else 1
    points = heldout.repeat(repeats, *[1] * (heldout.dim() - 1))
    points = points + noise * torch.randn(points.shape, generator=generator, device=points.device,
                                          dtype=points.dtype)
    energy = torch.cat([net(chunk).pow(2).flatten(1).sum(1) for chunk in points.split(1024)]).double()
    per_sample = energy.view(repeats, len(heldout)).mean(0)  # draws of one sample are not independent
    se = float(per_sample.std() / math.sqrt(len(per_sample))) if len(per_sample) > 1 else 0.0
    return float(energy.mean()), se


# --- score networks ---------------------------------------------------------------------------

class GaussianPlusResidual(nn.Module):
    """s(x) = -(x - mu)/(v + tau^2) + r(x): the fitted isotropic Gaussian's score plus a learned
    residual r whose last layer starts at zero, so training starts from the Gaussian estimate."""

    def __init__(self, residual: nn.Module, mean: Tensor, variance: float) -> None:
        super().__init__()
        self.residual = residual
        self.register_buffer("mean", mean)
        self.precision = 1.0 / variance

    def forward(self, x: Tensor) -> Tensor:
        return -(x - self.mean) * self.precision + self.residual(x)


def make_score_net(x: Tensor, noise: float, seed: int) -> nn.Module:
    """A score network sized to the input: small dilated conv net for images (C,H,W), MLP otherwise."""
    variance, _ = mean_variance(x)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        residual = _conv_residual(x.shape[1]) if x.dim() == 4 else _mlp_residual(x.shape[1:])
    last = [m for m in residual.modules() if isinstance(m, (nn.Linear, nn.Conv2d))][-1]
    nn.init.zeros_(last.weight)
    nn.init.zeros_(last.bias)
    return GaussianPlusResidual(residual, x.mean(0), variance + noise**2).to(x.device, x.dtype)


def _mlp_residual(shape: tuple[int, ...]) -> nn.Module:
    d = math.prod(shape)
    width = min(512, max(64, 2 * d))
    return nn.Sequential(nn.Flatten(), nn.Linear(d, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(),
                         nn.Linear(width, d), nn.Unflatten(1, tuple(shape)))


def _conv_residual(channels: int) -> nn.Module:
    """Dilations 1, 2, 4, 1: a 17x17 receptive field in four cheap layers."""
    width = max(16, 4 * channels)
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1), nn.SiLU(),
        nn.Conv2d(width, width, 3, padding=2, dilation=2), nn.SiLU(),
        nn.Conv2d(width, width, 3, padding=4, dilation=4), nn.SiLU(),
        nn.Conv2d(width, channels, 3, padding=1),
    )
