"""White-box optimisation inversion (Maeng et al., NeurIPS 2023, section 3.3 and appendix A.2).

Given an observed embedding z = f(x) + e, e ~ N(0, sigma^2 I), the attacker searches for the
input that explains it, with Adam on x (He et al., ACSAC 2019):

- unbiased attack (Maeng et al.'s (NeurIPS 2023) Attack-ub): minimise ||f(x) - z||^2;
- MAP attack (Attack-b): minimise ||f(x) - z||^2 + 2 sigma^2 (-log pi(x)), the negative log
  posterior up to a factor 2 sigma^2, so the prior weight sigma^2 is the one MAP implies, not
  a tuned constant. As sigma -> 0 the MAP estimate tends to argmax pi(x) subject to f(x) = z,
  which differs from the unbiased attack when f is not injective; the weight therefore uses
  sigma floored at 3% of the embeddings' spread, which approximated that limit best within the
  step budget on the sample models.

The prior pi (option prior), fitted to the aux data:

- "pca" (default): a Gaussian with the aux data's correlations, the probabilistic PCA of
  Tipping & Bishop (J. R. Stat. Soc. B 1999) on the pixels standardised by their aux spread: the
  top k principal directions with their variances and one residual variance for the rest, k
  chosen by the held-out likelihood of aux samples (k = 0 is the diagonal prior). Why: where f
  has a null space (a bottom that keeps 3 of a text line's 48 rows), a per-pixel prior can only
  pull the unseen pixels to their mean, while a correlated one infers them from the seen ones;
  for a linear f and Gaussian data, MAP with the true Gaussian prior at weight sigma^2 is the
  LMMSE estimator, which is never worse than the mean guess in expectation.
- "gaussian": the diagonal Gaussian, each pixel on its own.
- "tv": for images and (C, T) sequences, a total-variation prior pi ~ exp(-TV(x) / b) (TV along
  every spatial axis: 2-D for images, 1-D for sequences) whose Laplace scale b is fitted to the
  aux data's neighbour differences.

Where the inversion starts (option init) and how long it runs are chosen by a pilot on the
attacker's own held-out aux samples (`plan_inversion`): the aux mean, or (a learned
initialisation, the standard stronger attacker) the output of a decoder trained on the aux
embeddings (attacks/decoder.py's training, WARM_START's epoch cap), refined by the objectives above
for the number of steps that helped on the pilot, 0 included: the result is then the decoder's
output, which needs query access only. init=auto (default) trains the decoder only where the mean
start fails on the pilot, so models the plain inversion handles pay nothing for it.

Measured (benchmarks/RESULTS.md, `shapes_scale.py`): on the digits CNN the diagonal Gaussian beat
TV and their product at sigma in {0.1, 0.3, 1}, and PCA beats the diagonal Gaussian (MSE 1.67e-4
against 1.79e-4); on the 1-D audio bottom 0.137 against 0.156 (mean guess 0.241); on both auto keeps
the mean start and the whole step budget. On the text line no step or step count from the mean beats
the pilot's mean guess (0.0354: 100 Adam steps leave the pixels f does not see where they are), so
auto trains the decoder; refinement from its output made the pilot worse at every step tried, so 0
steps are kept: MSE 0.0304 against the mean guess 0.0353, the decoder's output.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from splitaudit.attacks.base import Attack, SeedOutcome
from splitaudit.attacks.decoder import DecoderOptions, decode, train_decoder, training_seconds
from splitaudit.attacks.parts.reconstruction import (
    data_range,
    mean_guess_baseline,
    reconstruction_examples,
    reconstruction_metrics,
)
from splitaudit.attacks.parts.text_metrics import with_token_metrics
from splitaudit.attacks.parts.token_relaxation import VocabularySimplex, quick_token_sentences, vocabulary_simplex
from splitaudit.context.audit_context import AuditContext
from splitaudit.core.errors import InputError
from splitaudit.core.memory import batch_within, per_sample_bytes
from splitaudit.core.options import option
from splitaudit.core.plateau import STOPPED_BY_CAP, STOPPED_BY_PLATEAU, Plateau
from splitaudit.core.threads import threads_for
from splitaudit.inputs.models import Encoder
from splitaudit.inputs.tokens import per_mask_pattern

PRIORS = ("gaussian", "pca", "tv")
INITS = ("auto", "mean", "decoder")
MAP_SIGMA_FLOOR = 0.03  # times the aux embeddings' std: the MAP weight's noise level at sigma = 0
VARIANCE_FLOOR = 1e-4  # times range^2: a constant pixel still gets a finite prior precision
OBJECTIVE_EVERY = 10  # steps between two checks of the objective for early stopping
STEP_FRACTIONS = (1.0, 0.3, 0.1, 0.03)  # of the lr option: the Adam steps the pilot tries
PILOT_TARGETS = 8  # aux samples the pilot inverts with each start and step (both variants)
PILOT_MARGIN = 0.1  # init=auto: the mean start must beat the pilot's mean guess by this share, or a decoder is tried
WARM_START = DecoderOptions(epochs=15)  # the warm start's decoder: the decoder attack's quick cap
PCA_FOLDS = 5  # aux folds whose held-out likelihood chooses the PCA prior's rank
RANK_TOLERANCE = 1e-10  # squared singular values below this share of the largest are rounding, not data


@dataclass(frozen=True)
class OptimizationOptions:
    """`[attack.optimization]`: the inversion's length, size, step and prior."""

    steps: int = option(200, "gradient step cap (the objective's plateau decides)", low=1)
    quick_steps: int = option(100, "gradient steps under --quick", low=1)
    samples: int = option(128, "target samples inverted", low=1)
    quick_samples: int = option(64, "target samples inverted under --quick", low=1)
    lr: float = option(
        0.1,
        "largest Adam step tried, in units of the data range (cosine-decayed; a pilot on aux samples picks)",
        above=0,
        high=1,
    )
    prior: str = option(
        "pca",
        "the MAP variant's prior: pca (the aux data's correlations), gaussian (diagonal), tv (images and sequences)",
        choices=PRIORS,
    )
    init: str = option(
        "auto",
        "where the inversion starts: mean (the aux mean), decoder (a decoder trained on the aux embeddings), "
        "auto (the decoder where the mean start fails on the attacker's held-out aux samples)",
        choices=INITS,
    )
    patience: int = option(
        3, f"checks of the objective (every {OBJECTIVE_EVERY} steps) without a better one before stopping", low=1
    )
    min_improvement: float = option(1e-3, "relative decrease of the objective that counts as better", low=0, below=1)


@dataclass
class ObjectiveStopping:
    """Early stopping of the inversion on its own objective (what the attacker minimises, never the
    targets): every OBJECTIVE_EVERY steps, stop after `patience` checks without a relative decrease
    of `min_improvement`, and keep the iterate of the best check. `runs` collects each chunk's Plateau."""

    patience: int
    min_improvement: float
    runs: list[Plateau] = field(default_factory=list)

    def details(self, cap: int) -> dict:
        """Steps run (the most over the chunks) and why the inversion ended (a plateau when every chunk did)."""
        plateaued = bool(self.runs) and all(run.stopped for run in self.runs)
        steps = max((run.last_step if run.stopped else cap for run in self.runs), default=cap)
        return {"steps_run": steps, "stopped_by": STOPPED_BY_PLATEAU if plateaued else STOPPED_BY_CAP}


class OptimizationAttack(Attack):
    """Inversion by gradient descent on the input: unbiased and MAP (Maeng et al., NeurIPS 2023, A.2),
    started from the aux mean or from a learned inverse, tuned on the attacker's own held-out aux.

    Metrics: "mse"/"psnr"/"ssim" of the stronger variant (the audit reports the worst case),
    plus "mse_unbiased" and "mse_map". Options (`[attack.optimization]`): steps (quick_steps
    under --quick; a cap), samples (quick_samples; on token inputs under --quick also at most
    QUICK_TOKEN_POSITIONS positions' worth of sentences): how many target samples are inverted, lr (the
    largest Adam step tried, in units of the data range, cosine-decayed), prior: "pca" (the aux data's
    correlations), "gaussian" (diagonal) or "tv" (images and sequences), init: where the inversion
    starts, "mean" (the aux mean), "decoder" (a decoder's output, attacks/decoder.py's training on the
    aux embeddings) or "auto" (the decoder only where the mean start fails on the pilot, below),
    patience and min_improvement: the inversion stops once its objective has not fallen by
    min_improvement (relative) in `patience` checks, every OBJECTIVE_EVERY steps, and returns the best
    checked iterate.

    The pilot (`plan_inversion`): the first `pilot_count` aux samples, whose inputs the attacker holds,
    are inverted from their observed embeddings with a prior, mean and decoder fitted without them;
    the start, the Adam step (a fraction of lr, STEP_FRACTIONS) and the number of steps (any check,
    every OBJECTIVE_EVERY steps, up to the cap; 0 returns the start itself) with the lowest MSE there
    are the ones the targets get. The targets are never read for any choice. Where the pilot keeps
    the decoder start with 0 steps, the attack's result IS the decoder's output: a query-access
    attack, reported here because the white-box attacker holds it too.
    """

    name = "optimization"
    kind = "reconstruction"
    primary_metric = "mse"
    needs = frozenset({"gradients"})
    title = "White-box inversion (optimization)"
    metrics = ("mse", "psnr", "ssim", "mse_unbiased", "mse_map")
    Options = OptimizationOptions
    assumptions = (
        "White-box: the attacker knows the bottom model's weights (it can differentiate f) and "
        "the noise level, observes the target embeddings, and fits its prior and starting "
        "point to auxiliary data from the same distribution: the aux mean, or the output of a decoder "
        "it trains on its aux embeddings (init=decoder, or init=auto where starting from the mean fails "
        "on its own held-out aux samples). How many refinement steps follow is chosen on those held-out "
        "aux samples and may be 0, in which case the result is the decoder's output."
    )

    def estimated_seconds(self, ctx: AuditContext, pass_seconds: float, timed: Callable) -> float:
        return self.estimated_range(ctx, pass_seconds, timed)[1]

    def estimated_range(self, ctx: AuditContext, pass_seconds: float, timed: Callable) -> tuple[float, float]:
        """(expected, at most) seconds. Encoder passes: steps x samples x 2 (unbiased and MAP inverted
        together), plus the pilot's (every fraction of lr on pilot_count aux samples, from each start it
        tries), and the warm start's decoder training at its cap (WARM_START), every seed; the prior's
        two fits (the pilot's and the attack's), once (`aux_prior`). init=auto trains the decoder (and
        pilots its start) only where the mean start fails on the pilot, which no estimate made before
        the run can know: the ceiling counts the decoder, and the expected time is the geometric mean
        of the two cases, within 2x of whichever happens while they differ by at most 4x (measured:
        the text line trains the decoder, 53 s without it, 177 s with it, 151 s measured; the 1-D
        audio bottom does not, 6 s and 23 s, 5.5 s measured; benchmarks/RESULTS.md, shapes_scale.py)."""
        opts = self.options(ctx)
        inits = pilot_inits(ctx, opts)
        per_start = opts.steps * 2 * len(STEP_FRACTIONS) * pilot_count(len(ctx.aux)) * pass_seconds
        targets = opts.steps * 2 * inverted_samples(ctx, opts) * pass_seconds
        mean = per_start if "mean" in inits else 0.0
        decoder = per_start + training_seconds(ctx, WARM_START, timed) if "decoder" in inits else 0.0
        fits = 2 * prior_fit_seconds(ctx.aux.x, opts.prior, timed)
        cap = len(ctx.seeds) * (targets + mean + decoder) + fits
        without_decoder = len(ctx.seeds) * (targets + mean) + fits
        return (math.sqrt(without_decoder * cap) if opts.init == "auto" else cap), cap

    def check_inputs(self, ctx: AuditContext) -> None:
        """Total variation sums differences of neighbouring pixels: tabular rows have none. Token
        inputs are inverted as logits over the vocabulary, which a decoder's output does not give."""
        opts = self.options(ctx)
        if opts.prior == "tv" and not ctx.space.spatial_axes:
            raise InputError(
                "attack option optimization.prior=tv needs images or sequences (total variation runs along their "
                f"spatial axes) and these inputs are {ctx.space.kind}; use optimization.prior=pca (the default) or gaussian"
            )
        if opts.init == "decoder" and ctx.space.kind == "tokens":
            raise InputError(
                "attack option optimization.init=decoder does not apply to token inputs (they are inverted as "
                "logits over the vocabulary); use optimization.init=mean or auto"
            )

    def run_seed(self, ctx: AuditContext, seed: int) -> SeedOutcome:
        self.check_inputs(ctx)
        opts = self.options(ctx)
        gen = ctx.generator(seed)
        n = inverted_samples(ctx, opts)
        index = torch.randperm(len(ctx.target), generator=gen, device=gen.device)[:n].sort().values
        z = ctx.observed_embeddings("target", gen)[index]
        x_true = ctx.target.x[index]
        weight = map_weight(ctx)
        simplex = vocabulary_simplex(ctx.tokens, ctx.aux) if ctx.space.kind == "tokens" else None
        stopping = ObjectiveStopping(opts.patience, opts.min_improvement)
        with threads_for(ctx.aux.x.numel(), ctx.device):
            mask = None if ctx.target.mask is None else ctx.target.mask[index]
            plan = plan_inversion(ctx, seed, gen, opts, weight, simplex)
            prior = aux_prior(ctx, opts.prior)
            start = None if plan.decoder is None else decode(plan.decoder, z)  # no decoder on token inputs
            both = per_mask_pattern(  # token inputs: each target inverted under its own attention mask
                ctx.tokens,
                mask,
                z,
                lambda part: torch.stack(
                    invert_both(
                        ctx, part, prior, weight, opts.steps, plan.lr, simplex, stopping, start=start, stop=plan.stop
                    ),
                    1,
                ),
            )
            x_unbiased, x_map = both[:, 0], both[:, 1]
        unbiased = reconstruction_metrics(x_true, x_unbiased, ctx.space)
        posterior = reconstruction_metrics(x_true, x_map, ctx.space)
        best, x_best = (posterior, x_map) if posterior["mse"] < unbiased["mse"] else (unbiased, x_unbiased)
        outcome = SeedOutcome(
            metrics={**best, "mse_unbiased": unbiased["mse"], "mse_map": posterior["mse"]},
            baseline=mean_guess_baseline(ctx.aux.x, x_true, ctx.space),
            examples=reconstruction_examples(x_true, x_best, index),
            details={
                "samples": n,
                "steps": opts.steps,
                **stopping.details(plan.stop),
                "prior": opts.prior,
                **({"prior_rank": prior.rank} if isinstance(prior, PcaPrior) else {}),
                "map_weight": weight,
                **plan.details(),
                "strongest": "map" if best is posterior else "unbiased",
                **({} if simplex is None else {"candidate_tokens": simplex.candidates}),
            },
        )
        return with_token_metrics(ctx, outcome, x_best, index)


def inverted_samples(ctx: AuditContext, opts: OptimizationOptions) -> int:
    """How many target samples are inverted: the run's samples (quick_samples under --quick,
    resolved by Attack.options), and under --quick on token inputs no more sentences than
    quick_token_sentences allows (a cap from the sentence length, not an option)."""
    n = min(len(ctx.target), opts.samples)
    if ctx.quick and ctx.space.kind == "tokens":
        n = min(n, quick_token_sentences(ctx.target.token_ids.shape[1]))
    return n


def prior_fit_seconds(aux_x: torch.Tensor, prior: str, timed: Callable) -> float:
    """Seconds of one fit of the prior to aux_x: for PCA, PCA_FOLDS + 1 spectra (the folds', each
    scored on its held-out part, and the final one), one spectrum of all aux timed here; the diagonal
    and TV priors' fits are a pass over aux, negligible."""
    if prior != "pca":
        return 0.0
    x = aux_x.detach().flatten(1).double()
    return (PCA_FOLDS + 1) * timed(lambda: _ppca_spectrum(x, VARIANCE_FLOOR))


def pilot_count(n_aux: int) -> int:
    """How many aux samples the pilot inverts: PILOT_TARGETS, at most half of aux, so that the
    rest (never fewer than the pilot samples) fits the pilot's prior and warm start."""
    return min(PILOT_TARGETS, n_aux // 2)


def pilot_inits(ctx: AuditContext, opts: OptimizationOptions) -> tuple[str, ...]:
    """The starts the pilot may try: auto tries the mean and, where that fails, the decoder (never on
    token inputs, inverted as logits)."""
    if opts.init == "auto":
        return ("mean",) if ctx.space.kind == "tokens" else ("mean", "decoder")
    return (opts.init,)


def map_weight(ctx: AuditContext) -> float:
    """sigma^2, with sigma floored at MAP_SIGMA_FLOOR times the spread of the aux embeddings."""
    spread = float(ctx.clean_embeddings("aux").std())
    return max(ctx.noise_sigma, MAP_SIGMA_FLOOR * spread) ** 2


_FITTED_PRIORS = WeakIdKeyDictionary()  # aux tensor -> {(prior, skip, unit_range): -log pi}


def aux_prior(ctx: AuditContext, prior: str, skip: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    """`fit_prior` on the aux samples after the first `skip`, fitted once per aux tensor and process:
    every seed and sweep point (`at_sigma` shares aux) reuses it; a worker process fits its own."""
    fits = _FITTED_PRIORS.setdefault(ctx.aux.x, {})
    key = (prior, skip, ctx.space.unit_range)
    if key not in fits:
        fits[key] = fit_prior(ctx.aux.x[skip:], prior, ctx.space.unit_range)
    return fits[key]


@dataclass
class InversionPlan:
    """What the pilot chose: the start ("mean" or "decoder", with its decoder), the Adam step, and the
    number of steps to run (`stop`); `scores`: the pilot's MSE per (start, step), at its best stop."""

    init: str
    lr: float
    stop: int
    decoder: nn.Module | None
    scores: dict[str, float]
    mean_guess: float
    pilots: int

    def details(self) -> dict:
        return {
            "init": self.init,
            "lr": self.lr,
            "steps_chosen": self.stop,
            "pilot_samples": self.pilots,
            "pilot_aux_mse": self.scores,
            "pilot_mean_guess": self.mean_guess,
        }


def plan_inversion(
    ctx: AuditContext,
    seed: int,
    gen: torch.Generator,
    opts: OptimizationOptions,
    weight: float,
    simplex: VocabularySimplex | None,
) -> InversionPlan:
    """The start, Adam step and step count that best invert the attacker's own first `pilot_count`
    aux samples from their observed embeddings (the MSE of both variants, averaged), tried over every
    fraction of lr and every check of the trajectory. The attacker holds these inputs; the targets
    are never looked at. The pilot's prior, mean and decoder come from the other aux samples: a prior
    fitted to the pilot samples themselves (the PCA prior spans them) would make the pilot score far
    too well. init=auto trains the decoder only when the mean start's best MSE is not PILOT_MARGIN
    below the pilot samples' mean guess (on the digits demo it is 400x below, and the decoder would
    cost more than the inversion). One step does not fit every bottom, and the objective alone
    misleads where f has a null space (benchmarks/RESULTS.md, `shapes_scale.py`)."""
    pilots = pilot_count(len(ctx.aux))
    x_true, rest = ctx.aux.x[:pilots], ctx.aux.x[pilots:]
    z = ctx.observed_embeddings("aux", gen)[:pilots]
    mask = None if ctx.aux.mask is None else ctx.aux.mask[:pilots]
    prior = aux_prior(ctx, opts.prior, skip=pilots)
    guess = float((rest.mean(dim=0, keepdim=True) - x_true).pow(2).mean())

    def scores(start: torch.Tensor | None) -> dict[tuple[float, int], float]:
        return pilot_scores(ctx, z, x_true, mask, rest, prior, weight, opts.steps, opts.lr, simplex, start)

    inits = pilot_inits(ctx, opts)
    tried = {"mean": scores(None)} if "mean" in inits else {}
    decoder = None
    if "decoder" in inits and (
        "mean" not in tried or min(tried["mean"].values(), key=_nan_last) > (1 - PILOT_MARGIN) * guess
    ):
        decoder = warm_start_decoder(ctx, seed, gen, pilots)
        tried["decoder"] = scores(decode(decoder, z))
    init, (lr, stop) = min(
        ((init, key) for init, by_key in tried.items() for key in by_key),
        key=lambda pair: _nan_last(tried[pair[0]][pair[1]]),
    )
    best_per_step = {
        f"{name} {step:.4g}": min((v for (s, _), v in by_key.items() if s == step), key=_nan_last)
        for name, by_key in tried.items()
        for step in dict.fromkeys(s for s, _ in by_key)
    }
    return InversionPlan(init, lr, stop, decoder if init == "decoder" else None, best_per_step, guess, pilots)


def _nan_last(value: float) -> tuple[bool, float]:
    return math.isnan(value), value


def pilot_scores(
    ctx: AuditContext,
    z: torch.Tensor,
    x_true: torch.Tensor,
    mask: torch.Tensor | None,
    prior_x: torch.Tensor,
    prior: Callable[[torch.Tensor], torch.Tensor],
    weight: float,
    steps: int,
    lr: float,
    simplex: VocabularySimplex | None,
    start: torch.Tensor | None,
) -> dict[tuple[float, int], float]:
    """{(step, stop): the MSE of both variants (averaged) after `stop` of `steps` steps} for every
    fraction of lr (STEP_FRACTIONS) and every stop in check_steps(steps), from `start` (default:
    prior_x's mean), without early stopping: one run per step gives its whole trajectory."""
    scores = {}
    for step in (lr * fraction for fraction in STEP_FRACTIONS):

        def path(part: torch.Tensor, step: float = step) -> torch.Tensor:
            both = invert_both(
                ctx, part, prior, weight, steps, step, simplex, prior_x=prior_x, start=start, trajectory=True
            )
            return torch.stack(both, 1)

        iterates = per_mask_pattern(ctx.tokens, mask, z, path)  # (n, 2, checks, *sample)
        errors = (iterates.detach() - x_true[:, None, None]).pow(2).flatten(3).mean(dim=(0, 1, 3))
        scores.update({(step, stop): float(error) for stop, error in zip(check_steps(steps), errors)})
    return scores


def check_steps(steps: int) -> list[int]:
    """The step counts at which the pilot scores its iterates: every OBJECTIVE_EVERY, and the cap."""
    return [*range(0, steps, OBJECTIVE_EVERY), steps]


def warm_start_decoder(ctx: AuditContext, seed: int, gen: torch.Generator, skip: int) -> nn.Module:
    """attacks/decoder.py's decoder, trained (WARM_START's cap) on the aux samples after the first
    `skip`: the pilot's samples stay unseen, so the pilot scores the decoder as it will meet targets."""
    decoder, _ = train_decoder(ctx.with_aux(slice(skip, None)), seed, gen, WARM_START)
    return decoder


def invert_both(
    ctx: AuditContext,
    z: torch.Tensor,
    prior: Callable[[torch.Tensor], torch.Tensor],
    weight: float,
    steps: int,
    lr: float,
    simplex: VocabularySimplex | None = None,
    stopping: ObjectiveStopping | None = None,
    *,
    prior_x: torch.Tensor | None = None,
    start: torch.Tensor | None = None,
    stop: int | None = None,
    trajectory: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(unbiased, MAP) reconstructions, optimised together as one batch (Adam is per
    coordinate, so without early stopping this equals two separate runs). The prior is fitted to
    `prior_x` (default: all aux), which also gives the default start (its mean) and the step's scale.
    start, stop, trajectory: as `invert`'s, per sample of z."""
    weights = torch.cat([torch.zeros(len(z)), torch.full((len(z),), weight)]).to(z.device)
    x = invert(
        ctx.encoder,
        torch.cat([z, z]),
        ctx.aux.x if prior_x is None else prior_x,
        prior,
        weights,
        steps,
        lr,
        simplex,
        stopping,
        unit_range=ctx.space.unit_range,
        start=None if start is None else torch.cat([start, start]),
        stop=stop,
        trajectory=trajectory,
    )
    return x[: len(z)], x[len(z) :]


def invert(
    encoder: Encoder,
    z: torch.Tensor,
    aux_x: torch.Tensor,
    prior: Callable[[torch.Tensor], torch.Tensor],
    prior_weight: torch.Tensor,
    steps: int,
    lr: float,
    simplex: VocabularySimplex | None = None,
    stopping: ObjectiveStopping | None = None,
    *,
    unit_range: bool,
    start: torch.Tensor | None = None,
    stop: int | None = None,
    trajectory: bool = False,
) -> torch.Tensor:
    """argmin_x ||f(x) - z||^2 + 2 w (-log pi(x)) per sample, by Adam from `start` (one row per sample
    of z; default the aux mean).

    prior: -log pi fitted to aux_x (`fit_prior`). stop: end after that many of the `steps` (the cosine
    schedule still spans `steps`: the run is the first `stop` steps of the capped one, as the pilot
    scored it). trajectory: return the iterates after each of check_steps(steps) steps, stacked on
    dim 1, instead of the last one (without early stopping).

    Iterates are clamped to [0, 1] when the input space lies there (`unit_range`: projected
    gradient descent); the step is scaled to the data's range (`data_range`).
    Token inputs (simplex given) are optimised as per-position logits over the vocabulary,
    x = softmax(logits) @ table (attacks/parts/token_relaxation.py says why).
    Samples are inverted in chunks whose saved activations fit the memory budget; the loss is a
    sum over samples and Adam works per coordinate, so chunks give the same result as one batch
    (`stopping` ends each chunk on its own objective, `steps` is then a cap).
    """
    if simplex is None:
        origin, to_input, step = aux_x.mean(dim=0, keepdim=True), lambda x: x, lr * data_range(aux_x, unit_range)
    else:
        origin, to_input, step = simplex.start[None], simplex.inputs, lr * simplex.step_unit
    start = origin if start is None else start
    size = batch_within(
        per_sample_bytes(
            lambda v: encoder(to_input(v.clone().requires_grad_(True))), origin.expand(2, *origin.shape[1:])
        ),
        len(z),
    )
    parts = [
        _invert_chunk(
            encoder,
            z[i : i + size],
            start if len(start) == 1 else start[i : i + size],
            to_input,
            prior,
            prior_weight[i : i + size],
            steps,
            step,
            simplex is None and unit_range,
            stopping,
            stop,
            trajectory,
        )
        for i in range(0, len(z), size)
    ]
    return torch.cat(parts)


def _invert_chunk(
    encoder: Encoder,
    z: torch.Tensor,
    start: torch.Tensor,
    to_input: Callable[[torch.Tensor], torch.Tensor],
    neg_log_prior,
    prior_weight: torch.Tensor,
    steps: int,
    lr: float,
    unit_range: bool,
    stopping: ObjectiveStopping | None = None,
    stop: int | None = None,
    trajectory: bool = False,
) -> torch.Tensor:
    """Adam on the variables v (the input, or token logits) with x = to_input(v)."""
    v = start.expand(len(z), *start.shape[1:]).clone().requires_grad_(True)
    optimizer = torch.optim.Adam([v], lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    plateau = Plateau(stopping.patience, stopping.min_improvement) if stopping else None
    checks, path = set(check_steps(steps)) if trajectory else set(), []
    for step in range(steps):
        if step == stop:
            break
        optimizer.zero_grad()
        x = to_input(v)
        if step in checks:
            path.append(x.detach().clone())
        fit = (encoder(x) - z).flatten(1).pow(2).sum(dim=1)
        objective = (fit + 2 * prior_weight * neg_log_prior(x)).sum()
        objective.backward()
        if (
            plateau
            and step % OBJECTIVE_EVERY == 0
            and plateau.update(step, float(objective.detach()), x.detach().clone)
        ):
            break
        optimizer.step()
        schedule.step()
        if unit_range:
            with torch.no_grad():
                v.clamp_(0, 1)
    if plateau:
        stopping.runs.append(plateau)
        if plateau.stopped:  # the iterate of the best check; at the cap, the last iterate as without stopping
            return plateau.best_state
    with torch.no_grad():
        last = to_input(v).detach()
    return torch.stack([*path, last], 1) if trajectory else last


def fit_prior(aux_x: torch.Tensor, prior: str, unit_range: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """-log pi(x) per sample (up to a constant) for a prior fitted to the aux data (unit_range:
    whether the input space lies in [0, 1], which sets the variance floor's scale)."""
    if prior == "tv":
        scale = total_variation(aux_x).mean() / _difference_count(aux_x.shape[1:])
        return lambda x: total_variation(x) / scale
    floor = VARIANCE_FLOOR * data_range(aux_x, unit_range) ** 2
    if prior == "pca":
        return fit_pca_prior(aux_x, floor)
    mean = aux_x.mean(dim=0, keepdim=True)
    variance = aux_x.var(dim=0, keepdim=True).clamp_min(floor)
    return lambda x: 0.5 * ((x - mean).pow(2) / variance).flatten(1).sum(dim=1)


@dataclass(frozen=True)
class PcaPrior:
    """-log pi(x) per sample, up to a constant, for the Gaussian pi = N(mean, S C S): S = diag(scale) the
    aux pixels' standard deviations, C = U diag(variances) U^T + residual (I - U U^T) the probabilistic
    PCA (Tipping & Bishop, J. R. Stat. Soc. B 1999) of the standardised aux, U (d x k) orthonormal.
    C^-1 = U diag(1 / variances) U^T + (I - U U^T) / residual (Woodbury's identity, exact for an
    orthonormal U), so a sample costs O(d k) and no d x d matrix is ever formed."""

    mean: torch.Tensor  # (d,)
    scale: torch.Tensor  # (d,)
    directions: torch.Tensor  # U, (d, k)
    variances: torch.Tensor  # (k,)
    residual: float

    @property
    def rank(self) -> int:
        return self.directions.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = (x.flatten(1) - self.mean) / self.scale
        along = w @ self.directions
        outside = w.pow(2).sum(dim=1) - along.pow(2).sum(dim=1)
        return 0.5 * ((along.pow(2) / self.variances).sum(dim=1) + outside / self.residual)


def fit_pca_prior(aux_x: torch.Tensor, floor: float) -> PcaPrior:
    """The probabilistic PCA prior of the aux data, its rank chosen by `pca_rank` (held-out
    likelihood on aux alone), each pixel's variance floored at `floor` as the diagonal prior's."""
    x = aux_x.detach().flatten(1).double()
    rank = pca_rank(x, floor)
    mean, scale, directions, variances, residuals = _ppca_spectrum(x, floor)
    as_x = functools.partial(torch.as_tensor, dtype=aux_x.dtype, device=aux_x.device)
    return PcaPrior(as_x(mean), as_x(scale), as_x(directions[:, :rank]), as_x(variances[:rank]), float(residuals[rank]))


def pca_rank(x: torch.Tensor, floor: float) -> int:
    """The number of principal directions k that maximises the Gaussian log-likelihood of held-out aux
    samples (PCA_FOLDS-fold cross-validation on aux; every k from 0, the diagonal prior's shape, to the
    training folds' rank): the data decide how far their correlations can be trusted, the targets are
    never read. Fewer than 3 samples leave no fold to hold out: k = 0."""
    n = len(x)
    folds = min(PCA_FOLDS, n)
    if n < 3:
        return 0
    total = None
    for fold in range(folds):
        held = torch.arange(n, device=x.device) % folds == fold
        scores = _held_out_log_likelihood(x[~held], x[held], floor)
        total = scores if total is None else total[: len(scores)] + scores[: len(total)]
    return int(total.argmax())


def _ppca_spectrum(x: torch.Tensor, floor: float):
    """(mean, scale, directions U (d x r), variances (r,), residuals (r + 1,)) of x standardised per pixel
    (scale: the pixels' standard deviations floored at sqrt(floor)): residuals[k] is the mean variance
    per dimension outside the first k directions, Tipping & Bishop's maximum-likelihood sigma^2 at rank
    k; variances and residuals floored at VARIANCE_FLOOR of a pixel's standardised variance (1), so that
    every variance is at least the residual that follows it. r < d, so a residual remains."""
    n, d = x.shape
    mean = x.mean(dim=0)
    scale = x.var(dim=0).clamp_min(floor).sqrt()
    w = (x - mean) / scale
    squares, directions = _principal_directions(w, min(n - 1, d - 1))
    rank = len(squares)
    variances = (squares / (n - 1)).clamp_min(VARIANCE_FLOOR)
    explained = torch.cat([variances.new_zeros(1), variances.cumsum(0)])
    total = w.pow(2).sum() / (n - 1)
    outside = d - torch.arange(rank + 1, dtype=x.dtype, device=x.device)
    residuals = ((total - explained) / outside).clamp_min(VARIANCE_FLOOR)
    return mean, scale, directions, variances, residuals


def _principal_directions(w: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `rank` largest squared singular values of w (n x d) and their right singular vectors (d x
    rank), from the eigenvectors of the smaller Gram matrix: w w^T (n x n) when n <= d, the right vectors
    then w^T v / s (6x faster than an SVD of a 320 x 27648 matrix). Values below RANK_TOLERANCE of the
    largest are rounding (repeated aux samples leave them): their vectors would not be orthonormal, so
    they are dropped."""
    if len(w) > w.shape[1]:
        squares, directions = _eigh(w.T @ w)
    else:
        squares, left = _eigh(w @ w.T)
        directions = (w.T @ left) / squares.clamp_min(torch.finfo(w.dtype).tiny).sqrt()
    squares, directions = squares.flip(0)[:rank], directions.flip(1)[:, :rank]
    kept = int((squares > RANK_TOLERANCE * squares[:1].clamp_min(0)).sum())
    return squares[:kept], directions[:, :kept]


def _eigh(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.linalg.eigh under threads_for's policy for its size: a 240 x 240 one took 3 s with two
    threads on busy cores and 0.05 s with one."""
    with threads_for(gram.numel(), gram.device):
        return torch.linalg.eigh(gram)


def _held_out_log_likelihood(train: torch.Tensor, held: torch.Tensor, floor: float) -> torch.Tensor:
    """Summed log-likelihood (up to a constant) of `held` under the PCA prior fitted to `train`, for every
    rank k = 0 .. r at once: the held-out projections' cumulative sums give each k's quadratic form."""
    mean, scale, directions, variances, residuals = _ppca_spectrum(train, floor)
    d, rank = directions.shape
    w = (held - mean) / scale
    along = (w @ directions).pow(2)
    zero = along.new_zeros(len(w), 1)
    inside = torch.cat([zero, (along / variances).cumsum(1)], dim=1)
    outside = w.pow(2).sum(dim=1, keepdim=True) - torch.cat([zero, along.cumsum(1)], dim=1)
    ks = torch.arange(rank + 1, dtype=w.dtype, device=w.device)
    log_det = torch.cat([variances.new_zeros(1), variances.log().cumsum(0)]) + (d - ks) * residuals.log()
    log_det = log_det + 2 * scale.log().sum()
    return -0.5 * (inside + outside / residuals + log_det).sum(dim=0)


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Anisotropic TV per sample: the sum of absolute differences of neighbours along every
    spatial axis (height and width of (C, H, W) images, time of (C, T) sequences)."""
    return sum(x.diff(dim=axis).abs().flatten(1).sum(dim=1) for axis in range(2, x.dim()))


def _difference_count(shape: tuple[int, ...]) -> int:
    """Neighbour differences total_variation sums over one sample of this (C, *size) shape."""
    channels, *size = shape
    return channels * sum(math.prod(size) // side * (side - 1) for side in size)
