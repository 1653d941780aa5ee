"""The prior term J(pi)/d of the van Trees bound (Maeng et al., NeurIPS 2023, Corollary 1, Section 3.2, A.1).

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
as failed. The bound then uses the Stam limit wherever there is one: it holds for every smoothed
prior, so the bound stays valid. Only without smoothing does a failed low estimate fall back to the
floor, which is itself only a lower limit on J (so the bound may still be too optimistic, and the
gate does not pass on it: audit/verdicts/gate.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from splitaudit.core.memory import PROBE_SAMPLES, batch_within, per_sample_bytes
from splitaudit.core.plateau import STOPPED_BY_CAP, Plateau, restore, snapshot
from splitaudit.core.registries import PRIORS, resolve
from splitaudit.core.threads import threads_for

DSM_NOISE_FRACTION = 0.1  # dsm without smoothing: noise level as a fraction of the data's std
FLOOR_SLACK_STDERRS = 3.0  # an estimate this many standard errors below the Gaussian floor fails
FULL_RESOLUTION_SIDE = 32  # images up to this side get the full-resolution score network
MAX_SCORE_WIDTH = 32  # channels of the multi-scale score network, whatever the input channels
MLP_MAX_INPUTS = 16384  # flat inputs beyond this would need a dense layer too large to train
STORED_DRAW_VALUES = 2**24  # held-out draws kept in memory up to this many values, else regenerated
MOMENT_BATCH = 256  # samples per step when taking means and variances in float64
MIN_CAPPED_EPOCHS = 3  # the work cap shrinks the training set before it goes below this many epochs


@dataclass(frozen=True)
class ScoreSettings:
    """Training budget of the score network (early stopping on the held-out loss).

    max_epochs is a cap: a training still improving there has not converged, and an undertrained
    score network underestimates J (`checked` then does not use the estimate). Measured (seed 0,
    patience 15): with 80 epochs the breast-cancer sample stopped at the cap with J/d = 59 and the
    digits sample (tau 0.25) with 11.8; with 300 they stop by themselves at 166 epochs (J/d = 364)
    and 145 (12.2). max_work bounds training samples x epochs x input dimensions, so that the cost
    stays bounded on large images (see within_work_cap): 1e8 is ~660 SSM sample-steps at 3x224x224,
    about 9 minutes on two busy CPU cores, and never binds on the digits sample.
    """

    max_epochs: int = 300
    patience: int = 15
    batch_size: int = 128
    lr: float = 1e-2
    max_samples: int = 2048
    heldout_fraction: float = 0.2
    eval_draws: int = 8  # smoothing draws per held-out sample when estimating J
    max_work: float = 1e8  # training samples x epochs x input dimensions


EXPECTED_EPOCHS = 170  # epochs the cost estimate expects: training stopped by itself at 115-166 of 300 (above)
QUICK_SCORE_SETTINGS = ScoreSettings(max_epochs=20, patience=5, max_samples=512, eval_draws=4, max_work=1e7)


def within_work_cap(n_samples: int, d: int, settings: ScoreSettings) -> ScoreSettings:
    """settings with fewer epochs, then fewer samples, so that training samples x epochs x d stays
    within settings.max_work (the same settings when the cap does not bind).

    Epochs go first (down to MIN_CAPPED_EPOCHS), since early stopping often ends training before
    max_epochs anyway; below that the training set shrinks. The score net starts from the Gaussian
    fit, so a short training moves the estimate less far from the floor, never past its checks.
    """
    n = min(n_samples, settings.max_samples)
    n_train = n - max(1, int(round(settings.heldout_fraction * n)))
    steps = settings.max_work / d  # sample-steps the cap allows
    if n_train * settings.max_epochs <= steps:
        return settings
    epochs = min(settings.max_epochs, max(MIN_CAPPED_EPOCHS, int(steps // max(1, n_train))))
    samples = n if n_train * epochs <= steps else max(2, int(steps / epochs / (1 - settings.heldout_fraction)))
    return dataclasses.replace(
        settings, max_epochs=epochs, patience=min(settings.patience, epochs), max_samples=min(n, samples)
    )


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


def estimate_prior(
    x: Tensor,
    method: str,
    smoothing: float,
    seed: int = 0,
    settings: ScoreSettings = ScoreSettings(),
    on_epoch: Callable[[], None] | None = None,
) -> PriorEstimate:
    """J(pi_tau)/d from samples x of pi (tau = smoothing) by the registered prior `method`
    (splitaudit.core.registries.PRIORS), checked against its limits."""
    if method not in PRIORS:
        raise ValueError(f"unknown prior method {method!r}; choose {', '.join(PRIORS)}")
    if not PRIORS[method].trains:
        return checked(resolve(PRIORS[method].function)(x, smoothing))
    return checked(score_matching_prior(x, method, smoothing, seed, settings, on_epoch))


def score_loss(method: str) -> Callable[[nn.Module, Tensor, float, tuple[Tensor, Tensor]], Tensor]:
    """The score-matching loss the registered prior `method` names."""
    return resolve(PRIORS[method].function)


def mean_variance(x: Tensor) -> tuple[float, float]:
    """Mean per-dimension variance of x and its standard error (over samples)."""
    _, spread = sample_moments(x, torch.arange(len(x), device=x.device))
    return float(spread.mean()), float(spread.std() / math.sqrt(len(spread))) if len(spread) > 1 else 0.0


def sample_moments(x: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """(mean sample, per-sample mean squared deviation with Bessel's correction) of x[index], in
    float64 and in batches, so that large images are never copied whole."""
    total = torch.zeros(x.shape[1:], dtype=torch.float64, device=x.device)
    for part in index.split(MOMENT_BATCH):
        total += x[part].double().sum(0)
    mean = total / len(index)
    spread = torch.cat([(x[part].double() - mean).pow(2).flatten(1).mean(1) for part in index.split(MOMENT_BATCH)])
    return mean.to(x.dtype), spread * len(index) / max(1, len(index) - 1)


def gaussian_prior(x: Tensor, smoothing: float) -> PriorEstimate:
    """Isotropic Gaussian fit: J/d = 1/(v + tau^2), v the mean per-dimension variance."""
    variance, variance_se = mean_variance(x)
    total = variance + smoothing**2
    j = 1.0 / total if total > 0 else math.inf
    return PriorEstimate(
        method="gaussian",
        smoothing=smoothing,
        j_over_d=j,
        stderr=variance_se / total**2 if total > 0 else 0.0,
        gaussian_floor=j,
        stam_limit=stam_limit(smoothing),
    )


def finite_table_prior(method: str, tau: float, x: Tensor) -> PriorEstimate:
    """The prior term of inputs that take finitely many values (token embeddings: rows of a table).
    At tau = 0 it is infinite, so the van Trees bound is 0 (only Cramér-Rao remains). At tau > 0 it is
    Stam's limit 1/tau^2, not an estimate: the smoothed prior is a mixture of N(row, tau^2 I) over the
    rows; where rows lie more than a few tau apart its J/d is about 1/tau^2, the most any prior
    smoothed with tau can have. Score matching underestimates such peaked mixtures and a Gaussian fit
    (the floor) is far below them, which would make the bound too optimistic; the limit is valid for
    every prior."""
    if tau == 0:
        return PriorEstimate(
            method=method,
            smoothing=0.0,
            j_over_d=math.inf,
            stderr=0.0,
            gaussian_floor=math.nan,
            stam_limit=None,
            valid=False,
            j_over_d_used=math.inf,
            notes=[
                "token embeddings take finitely many values (rows of the embedding table): their prior has "
                "infinite Fisher information, so without smoothing (--smoothing > 0) the van Trees bound is 0"
            ],
        )
    limit = 1.0 / tau**2
    variance = float(x.flatten(1).var(dim=0).mean())
    return PriorEstimate(
        method=method,
        smoothing=tau,
        j_over_d=limit,
        stderr=0.0,
        gaussian_floor=1.0 / (variance + tau**2),
        stam_limit=limit,
        j_over_d_used=limit,
        notes=[
            f"token inputs: J/d is Stam's limit 1/tau^2 = {limit:.4g} (valid for every prior smoothed with "
            f"tau = {tau:.4g}), not a {method} estimate: the smoothed prior of a finite vocabulary is a "
            "mixture of narrow Gaussians whose J/d approaches that limit, which score matching and a "
            "Gaussian fit underestimate (both would overstate the bound)"
        ],
    )


def stam_limit(noise: float) -> float | None:
    """Stam's inequality: J(pi * N(0, noise^2 I))/d <= 1/noise^2 for every pi."""
    return 1.0 / noise**2 if noise > 0 else None


def checked(estimate: PriorEstimate) -> PriorEstimate:
    """Flag an estimate above the Stam limit, clearly below the Gaussian floor, or from a score
    network still improving at its epoch cap (an underestimate); the bound then uses the Stam
    limit, which holds for every smoothed prior, so that bound stays valid."""
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
            "every prior smoothed with this tau; the bound uses the limit instead (valid, possibly loose)"
        )
    elif j + FLOOR_SLACK_STDERRS * estimate.stderr < floor * (1 - 1e-9):
        estimate.valid = False
        estimate.j_over_d_used = limit if limit is not None else floor
        estimate.notes.append(
            f"failed estimate: J/d = {j:.4g} is below the Gaussian floor 1/variance = {floor:.4g}, which "
            "every prior reaches, so score matching underestimated it; "
            + (
                f"the bound uses Stam's limit 1/tau^2 = {limit:.4g} instead, which holds for every prior "
                "smoothed with this tau (valid, possibly loose): the floor is only a lower limit on J and "
                "could still overstate the bound"
                if limit is not None
                else "the bound uses the floor instead, which is only a lower limit on J, so the bound may still "
                "be too optimistic and the bound gate does not pass on it; score matching is unreliable on data "
                "with bounded or low-dimensional support: randomized smoothing (--smoothing) gives it a valid "
                "fallback (Maeng et al., NeurIPS 2023, A.1)"
            )
        )
    elif estimate.details.get("stopped_by") == STOPPED_BY_CAP:
        estimate.valid = False
        estimate.j_over_d_used = limit if limit is not None else j
        estimate.notes.append(
            f"not converged: the score network's held-out loss was still improving at its cap of "
            f"{estimate.details['epochs']} epochs, and an undertrained score network underestimates J "
            f"(J/d = {j:.4g} is a lower estimate); "
            + (
                f"the bound uses Stam's limit 1/tau^2 = {limit:.4g} instead, which holds for every prior "
                "smoothed with this tau (valid, possibly loose)"
                if limit is not None
                else "the bound may be too optimistic and the bound gate does not pass on it; randomized "
                "smoothing (--smoothing) gives a valid fallback (Maeng et al., NeurIPS 2023, A.1)"
            )
        )
    return estimate


# --- score matching ---------------------------------------------------------------------------


def score_matching_prior(
    x: Tensor,
    method: str,
    smoothing: float,
    seed: int,
    settings: ScoreSettings,
    on_epoch: Callable[[], None] | None = None,
) -> PriorEstimate:
    """Train a score network by SSM-VR or DSM on (smoothed) x; J = mean ||s||^2 on held-out data."""
    variance, _ = mean_variance(x)
    noise = smoothing
    notes = []
    if PRIORS[method].needs_noise and noise == 0:
        noise = DSM_NOISE_FRACTION * math.sqrt(variance)
        notes.append(
            f"{method} needs a noise level: it estimates the prior smoothed by N(0, {noise:.3g}^2) "
            "(no --smoothing given), which slightly underestimates J"
        )
    asked, settings = settings, within_work_cap(len(x), x[0].numel(), settings)
    if settings != asked:
        notes.append(
            f"training cut by the work cap ({asked.max_work:.3g} samples x epochs x dimensions): at most "
            f"{settings.max_epochs} epochs on at most {settings.max_samples} samples (asked "
            f"{asked.max_epochs} on {min(len(x), asked.max_samples)}); the estimate may sit nearer the "
            "Gaussian floor than a longer training would put it"
        )
    generator = torch.Generator(device=x.device).manual_seed(seed)
    train, heldout = _split(x, settings, generator)
    loss = score_loss(method)
    with threads_for(x.numel(), x.device):
        net, info = train_score_net(x, train, heldout, loss, noise, settings, generator, seed, on_epoch)
        j, se = _score_energy(net, x, heldout, noise, settings.eval_draws, generator, info["batch_size"])
    d = x[0].numel()
    return PriorEstimate(
        method=method,
        smoothing=smoothing,
        j_over_d=j / d,
        stderr=se / d,
        gaussian_floor=1.0 / (variance + noise**2),
        stam_limit=stam_limit(noise),
        notes=notes,
        details={
            **info,
            "noise": noise,
            "n_train": len(train),
            "n_heldout": len(heldout),
            "max_epochs": settings.max_epochs,
            "work_capped": settings != asked,
        },
    )


def _split(x: Tensor, settings: ScoreSettings, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Seeded subsample (at most max_samples) split into training and held-out indices into x
    (indices, not copies: at 3x224x224 a copy of the training set alone is ~1 GiB)."""
    perm = torch.randperm(len(x), generator=generator, device=x.device)[: settings.max_samples]
    n_heldout = max(1, int(round(settings.heldout_fraction * len(perm))))
    if len(perm) - n_heldout < 1:
        raise ValueError(f"score matching needs at least 2 samples, got {len(x)}")
    return perm[n_heldout:], perm[:n_heldout]


def train_score_net(
    x: Tensor,
    train: Tensor,
    heldout: Tensor,
    loss_fn,
    noise: float,
    settings: ScoreSettings,
    generator: torch.Generator,
    seed: int,
    on_epoch: Callable[[], None] | None = None,
) -> tuple[nn.Module, dict]:
    """Adam on the score-matching loss over x[train], stopped when the held-out loss stops improving.

    Mini-batches hold settings.batch_size samples, fewer when their saved activations would not
    fit in the memory budget (large images); the held-out loss is evaluated in such batches too.
    """
    net = make_score_net(x, train, noise, seed)
    optimizer = torch.optim.Adam(net.parameters(), lr=settings.lr)
    batch = score_batch_size(net, x[train[:PROBE_SAMPLES]], loss_fn, noise, settings.batch_size)
    heldout_draws = _heldout_draws(x, heldout, generator)  # fixed, so that held-out losses are comparable
    initial, plateau = snapshot(net)(), Plateau(settings.patience)
    for epoch in range(1, settings.max_epochs + 1):
        for index in train[torch.randperm(len(train), generator=generator, device=train.device)].split(batch):
            points = x[index]
            optimizer.zero_grad()
            loss_fn(net, points, noise, _draws(points, generator)).backward()
            optimizer.step()
        current = _heldout_loss(net, x, heldout, loss_fn, noise, heldout_draws, batch)
        if on_epoch is not None:
            on_epoch()
        if plateau.update(epoch, current, snapshot(net)):
            break
    restore(plateau.best_state or initial, net)  # never finite: the initial net, whose J checked() judges
    details = plateau.details("epochs")
    return net.eval(), {
        "epochs": details["epochs_trained"],
        "stopped_by": details["stopped_by"],
        "heldout_loss": plateau.best,
        "batch_size": batch,
        "parameters": sum(p.numel() for p in net.parameters()),
    }


def score_training_step(x: Tensor, method: str, noise: float, batch_size: int) -> tuple[Callable[[], None], int]:
    """One training step of the score network on a batch of x as train_score_net forms it (batch_size
    samples, fewer where their saved activations exceed the memory budget), as a callable, and the
    batch's size: the audit's up-front cost estimate times it. Timed on the real batch, not on a
    couple of samples: a small network's step costs about the same on 2 samples as on 128 (the
    digits prior was estimated at 587 s from steps of 2 samples, and trained in 29 CPU s)."""
    loss_fn = score_loss(method)
    noise = noise if noise > 0 else DSM_NOISE_FRACTION
    net = make_score_net(x, torch.arange(min(len(x), batch_size), device=x.device), noise, 0)
    batch = score_batch_size(net, x[:PROBE_SAMPLES], loss_fn, noise, min(len(x), batch_size))
    probe, generator = x[:batch], torch.Generator(device=x.device).manual_seed(0)
    return (lambda: loss_fn(net, probe, noise, _draws(probe, generator)).backward()), batch


def score_batch_size(net: nn.Module, probe: Tensor, loss_fn, noise: float, cap: int) -> int:
    """settings.batch_size, or fewer samples when one step's saved activations exceed the budget."""
    generator = torch.Generator(device=probe.device).manual_seed(0)
    cost = per_sample_bytes(lambda batch: loss_fn(net, batch, noise, _draws(batch, generator)), probe)
    net.zero_grad(set_to_none=True)
    return batch_within(cost, cap)


def _heldout_draws(x: Tensor, heldout: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor] | int:
    """The held-out samples' draws, the same every epoch: stored when small, else a seed to
    regenerate them from (two draws per value of a 3x224x224 held-out set are ~1 GiB)."""
    if 2 * len(heldout) * x[0].numel() <= STORED_DRAW_VALUES:
        return _draws(x[heldout], generator)
    return int(torch.randint(2**62, (1,), generator=generator, device=generator.device))


def _heldout_loss(
    net: nn.Module, x: Tensor, heldout: Tensor, loss_fn, noise: float, draws: tuple[Tensor, Tensor] | int, batch: int
) -> float:
    """The mean loss on the held-out samples under their fixed draws, in batches of `batch`."""
    generator = torch.Generator(device=x.device).manual_seed(draws) if isinstance(draws, int) else None
    total = 0.0
    for start, index in zip(range(0, len(heldout), batch), heldout.split(batch)):
        points = x[index]
        part = (
            _draws(points, generator) if generator is not None else tuple(d[start : start + len(index)] for d in draws)
        )
        total += float(loss_fn(net, points, noise, part).detach()) * len(index)
    return total / len(heldout)


def _draws(x: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(Gaussian smoothing noise, Rademacher projection) for one pass over x."""
    eps = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    bits = torch.randint(0, 2, x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return eps, 2 * bits - 1


def ssm_vr_loss(net: nn.Module, x: Tensor, noise: float, draws: tuple[Tensor, Tensor]) -> Tensor:
    """SSM-VR: E[v^T grad_x(v^T s(x)) + 1/2 ||s(x)||^2] at x ~ pi_tau (Song et al. 2019, Eq. 8)."""
    eps, v = draws
    point = (x + noise * eps).requires_grad_(True)
    score = net(point)
    grad_vs = torch.autograd.grad((score * v).sum(), point, create_graph=True)[0]
    return ((grad_vs * v).flatten(1).sum(1) + 0.5 * score.pow(2).flatten(1).sum(1)).mean()


def dsm_loss(net: nn.Module, x: Tensor, noise: float, draws: tuple[Tensor, Tensor]) -> Tensor:
    """DSM: E||s(x~) + (x~ - x)/tau^2||^2 with x~ = x + tau eps; minimised by the score of pi_tau."""
    eps, _ = draws
    return (net(x + noise * eps) + eps / noise).pow(2).flatten(1).sum(1).mean()


@torch.no_grad()
def _score_energy(
    net: nn.Module, x: Tensor, heldout: Tensor, noise: float, draws: int, generator: torch.Generator, batch: int
) -> tuple[float, float]:
    """J_hat = mean ||s(x~)||^2 over held-out x~ ~ pi_tau, and its standard error.

    Draw by draw and in batches of the training batch size, so memory stays that of one batch."""
    repeats = draws if noise > 0 else 1
    energy = torch.zeros(repeats, len(heldout), dtype=torch.float64, device=x.device)
    for r in range(repeats):
        for start, index in zip(range(0, len(heldout), batch), heldout.split(batch)):
            points = x[index]
            points = points + noise * torch.randn(
                points.shape, generator=generator, device=points.device, dtype=points.dtype
            )
            energy[r, start : start + len(index)] = net(points).pow(2).flatten(1).sum(1).double()
    per_sample = energy.mean(0)  # draws of one sample are not independent
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


def make_score_net(x: Tensor, train: Tensor, noise: float, seed: int) -> nn.Module:
    """A score network sized to the input (x[train] are its training samples): a small dilated
    conv net for small images and for (C, T) sequences, a multi-scale one for large images
    (C,H,W), an MLP for flat inputs."""
    mean, spread = sample_moments(x, train)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        residual = _conv_residual(tuple(x.shape[1:])) if x.dim() in (3, 4) else _mlp_residual(x.shape[1:])
    for last in _output_layers(residual):
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
    return GaussianPlusResidual(residual, mean, float(spread.mean()) + noise**2).to(x.device, x.dtype)


def _output_layers(residual: nn.Module) -> list[nn.Module]:
    """The layers whose zero init makes the residual start at zero."""
    if isinstance(residual, MultiScaleResidual):
        return [residual.local[-1], residual.coarse[-1]]
    return [[m for m in residual.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))][-1]]


def _mlp_residual(shape: tuple[int, ...]) -> nn.Module:
    d = math.prod(shape)
    width = min(512, max(64, 2 * d))
    if d > MLP_MAX_INPUTS:
        raise ValueError(
            f"score matching on flat inputs of {d} dimensions needs a {d}x{width} dense layer; "
            f"pass image data as C,H,W (--input-shape) or use --prior gaussian"
        )
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(d, width),
        nn.SiLU(),
        nn.Linear(width, width),
        nn.SiLU(),
        nn.Linear(width, d),
        nn.Unflatten(1, tuple(shape)),
    )


def _conv_residual(shape: tuple[int, ...]) -> nn.Module:
    """Dilations 1, 2, 4, 1: a 17x17 receptive field in four cheap layers (images up to
    FULL_RESOLUTION_SIDE; (C, T) sequences of any length, with Conv1d: a 17-step window, at a
    cost linear in T); larger images get the multi-scale network."""
    channels, *size = shape
    if len(size) == 2 and max(size) > FULL_RESOLUTION_SIDE:
        return MultiScaleResidual(channels, downsamplings(max(size)))
    conv = nn.Conv2d if len(size) == 2 else nn.Conv1d
    width = max(16, 4 * channels)
    return nn.Sequential(
        conv(channels, width, 3, padding=1),
        nn.SiLU(),
        conv(width, width, 3, padding=2, dilation=2),
        nn.SiLU(),
        conv(width, width, 3, padding=4, dilation=4),
        nn.SiLU(),
        conv(width, channels, 3, padding=1),
    )


def downsamplings(side: int) -> int:
    """Stride-2 steps that bring an image side down to FULL_RESOLUTION_SIDE or below."""
    return max(0, math.ceil(math.log2(side / FULL_RESOLUTION_SIDE)))


class MultiScaleResidual(nn.Module):
    """Residual score for large images, with a cost linear in the pixels and a capped width.

    local: a narrow 3x3 conv pair at full resolution (pixel-scale structure); coarse: stride-2
    convs down to at most FULL_RESOLUTION_SIDE pixels a side, the dilated block there (a 17x17
    receptive field at that scale), and a conv to the input channels, upsampled bilinearly.
    No layer is dense over the image, so parameters do not grow with the resolution.
    """

    def __init__(self, channels: int, levels: int) -> None:
        super().__init__()
        width = min(MAX_SCORE_WIDTH, max(16, 4 * channels))
        local = max(8, 2 * channels)
        self.local = nn.Sequential(
            nn.Conv2d(channels, local, 3, padding=1), nn.SiLU(), nn.Conv2d(local, channels, 3, padding=1)
        )
        down: list[nn.Module] = []
        for level in range(levels):
            down += [nn.Conv2d(channels if level == 0 else width, width, 3, stride=2, padding=1), nn.SiLU()]
        self.coarse = nn.Sequential(
            *down,
            nn.Conv2d(width, width, 3, padding=2, dilation=2),
            nn.SiLU(),
            nn.Conv2d(width, width, 3, padding=4, dilation=4),
            nn.SiLU(),
            nn.Conv2d(width, channels, 3, padding=1),
        )

    def forward(self, x: Tensor) -> Tensor:
        coarse = F.interpolate(self.coarse(x), size=x.shape[-2:], mode="bilinear", align_corners=False)
        return self.local(x) + coarse
