"""Decoder inversion: a network learns to map embeddings back to inputs (Zhu et al., NDSS 2025;
Maeng et al., NeurIPS 2023).

The learned ("DNN-based") reconstruction attack of Maeng et al. (NeurIPS 2023, section 3.3.2; He et al. 2019)
and the query-access reference for SDAR (Zhu et al., NDSS 2025): the attacker embeds its auxiliary data
with the bottom model, adds the deployed noise itself, trains a decoder on the pairs
(f(x_aux) + noise, x_aux) and applies it to the target embeddings it observes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from splitaudit.attacks.base import Attack, SeedOutcome
from splitaudit.attacks.parts.nets import Decoder, decode_batch, seeded
from splitaudit.attacks.parts.reconstruction import (
    mean_guess_baseline,
    reconstruction_examples,
    reconstruction_metrics,
)
from splitaudit.attacks.parts.text_metrics import with_token_metrics
from splitaudit.context.audit_context import AuditContext
from splitaudit.core.options import option
from splitaudit.core.plateau import (
    MIN_PATIENCE_STEPS,
    Plateau,
    epochs_of_patience,
    restore,
    snapshot,
    steps_per_epoch,
)
from splitaudit.core.threads import threads_for

# `epochs` is a cap; the hold-out early stopping decides, with a patience of at least 200 optimiser
# steps (benchmarks/decoder_curve.py): on the digits CNN (13 steps an epoch, so 16 epochs) seeds 0/1
# stop at epochs 76/93 (best 60/77, target MSE 0.0084/0.0080), where 8 epochs stopped seed 1 at 27
# (0.0113). Expected share of the capped training's time that runs: 0.38-0.47 of the cap there, 0.32
# on benchmarks/shapes_scale.py's text line (CPU seconds, before the floor), the whole cap on small
# aux data; 0.5 is within 2x of any run that stops between a quarter of the cap and the cap.
EXPECTED_SHARE = 0.5


@dataclass(frozen=True)
class DecoderOptions:
    """`[attack.decoder]`: the decoder's training."""

    epochs: int = option(200, "epoch cap (hold-out early stopping decides)", low=1)
    quick_epochs: int = option(15, "epoch cap under --quick", low=1)
    lr: float = option(5e-3, "Adam learning rate", above=0, high=1)
    batch_size: int = option(64, "training batch size", low=1)
    patience: int = option(8, "epochs without a better hold-out MSE before stopping", low=1)
    patience_steps: int = option(
        MIN_PATIENCE_STEPS, "optimiser steps the patience spans at least (small aux data: more epochs)", low=0
    )
    holdout_fraction: float = option(0.1, "share of the aux data held out for early stopping", above=0, below=1)


class DecoderAttack(Attack):
    """Learned inversion with query access: decoder trained on (f(x_aux) + noise, x_aux).

    Options (`[attack.decoder]`): epochs (a cap; quick_epochs under --quick), lr, batch_size,
    patience (epochs without a better hold-out MSE before stopping, at least patience_steps
    optimiser steps), holdout_fraction.
    Example: `splitaudit run model.onnx --aux data.npz --attacks decoder`.
    """

    name = "decoder"
    kind = "reconstruction"
    primary_metric = "mse"
    relative_cost = 10.0  # digits CNN on one CPU core: ~7 s a seed, most attacks ~1 s
    needs = frozenset()
    title = "Learned inversion (decoder)"
    metrics = ("mse", "psnr", "ssim")
    Options = DecoderOptions
    assumptions = (
        "The attacker observes the target embeddings (with the deployed noise) and can run the "
        "bottom model as a black box on its own auxiliary data from the same distribution; it "
        "knows the noise level. It trains a decoder from embeddings to inputs on that data."
    )

    def estimated_seconds(self, ctx: AuditContext, pass_seconds: float, timed: Callable) -> float:
        """Its training at the epoch cap, an upper bound (early stopping usually ends it sooner), every seed."""
        return len(ctx.seeds) * training_seconds(ctx, self.options(ctx), timed)

    def expected_share_of_cap(self, ctx: AuditContext) -> float:
        """EXPECTED_SHARE of the epoch cap; the quick cap (15 epochs) is all run: with patience 8 the
        hold-out rarely stops it first (on the text line the best epoch was the 15th)."""
        return 1.0 if ctx.quick else EXPECTED_SHARE

    def run_seed(self, ctx: AuditContext, seed: int) -> SeedOutcome:
        gen = ctx.generator(seed)
        with threads_for(ctx.aux.x.numel(), ctx.device):
            decoder, details = train_decoder(ctx, seed, gen, self.options(ctx))
            x_hat = decode(decoder, ctx.observed_embeddings("target", gen))
            averaged = decode(decoder, ctx.observed_embeddings("target", gen, ctx.queries)) if ctx.queries > 1 else None
        x_true = ctx.target.x
        metrics = reconstruction_metrics(x_true, x_hat, ctx.space)
        if averaged is not None:  # the same decoder on the mean of k sends of each target input
            metrics["k_query"] = reconstruction_metrics(x_true, averaged, ctx.space)
            details["queries"] = ctx.queries
        outcome = SeedOutcome(
            metrics=metrics,
            baseline=mean_guess_baseline(ctx.aux.x, x_true, ctx.space),
            examples=reconstruction_examples(x_true, x_hat),
            details=details,
        )
        return with_token_metrics(ctx, outcome, x_hat)


def training_seconds(ctx: AuditContext, opts: DecoderOptions, timed: Callable) -> float:
    """One training at opts' epoch cap on all aux: a training step timed on a batch of this model's
    embeddings, times the steps of every epoch."""
    batch = max(2, min(opts.batch_size, len(ctx.aux)))
    decoder, optimizer = new_decoder(ctx, 0, opts.lr)
    z, x = ctx.clean_embeddings("aux")[:batch], ctx.aux.x[:batch]
    with threads_for(ctx.aux.x.numel(), ctx.device):
        step = timed(lambda: train_step(decoder.train(), optimizer, z, x))
    n_train = len(ctx.aux) - max(1, math.ceil(opts.holdout_fraction * len(ctx.aux)))
    return opts.epochs * math.ceil(n_train / opts.batch_size) * step


def new_decoder(ctx: AuditContext, seed: int, lr: float) -> tuple[Decoder, torch.optim.Optimizer]:
    """A seeded decoder for the context's shapes and its Adam optimiser."""
    with seeded(seed):
        decoder = Decoder(ctx.encoder.output_shape, ctx.space).to(ctx.device)
    return decoder, torch.optim.Adam(decoder.parameters(), lr=lr)


def train_decoder(
    ctx: AuditContext,
    seed: int,
    gen: torch.Generator,
    opts: DecoderOptions,
    on_epoch: Callable[[int, float, Decoder], None] | None = None,
) -> tuple[Decoder, dict]:
    """Adam on the MSE, fresh noise on the aux embeddings every epoch, early stopping on a
    held-out slice of the aux data (patience of at least opts.patience_steps optimiser steps);
    returns the decoder at its best hold-out epoch. `opts` is the
    run's (Attack.options: under --quick, epochs is already quick_epochs). `on_epoch(epoch,
    holdout_mse, decoder)` sees every epoch (benchmarks/decoder_curve.py records learning curves)."""
    n = len(ctx.aux)
    order = torch.randperm(n, generator=gen, device=gen.device)
    n_holdout = max(1, math.ceil(opts.holdout_fraction * n))
    holdout, train = order[:n_holdout], order[n_holdout:]
    decoder, optimizer = new_decoder(ctx, seed, opts.lr)
    patience = epochs_of_patience(opts.patience, steps_per_epoch(len(train), opts.batch_size), opts.patience_steps)
    plateau = Plateau(patience)
    with ctx.progress(total=opts.epochs, desc="decoder") as bar:
        for epoch in range(1, opts.epochs + 1):
            z = ctx.observed_embeddings("aux", gen)
            train_epoch(decoder, optimizer, z[train], ctx.aux.x[train], opts.batch_size, gen)
            holdout_mse = float((decode(decoder, z[holdout]) - ctx.aux.x[holdout]).pow(2).mean())
            bar.update()
            if on_epoch is not None:
                on_epoch(epoch, holdout_mse, decoder)
            if plateau.update(epoch, holdout_mse, snapshot(decoder)):
                break
    restore(plateau.best_state, decoder)
    return decoder, {
        **plateau.details("epochs"),
        "patience_epochs": patience,
        "holdout_mse": plateau.best,
        "n_train": len(train),
        "n_holdout": n_holdout,
    }


def train_epoch(
    decoder: nn.Module,
    optimizer: torch.optim.Optimizer,
    z: torch.Tensor,
    x: torch.Tensor,
    batch_size: int,
    gen: torch.Generator,
) -> None:
    """One shuffled pass; batches of one sample are dropped (batch norm needs two)."""
    decoder.train()
    for batch in torch.randperm(len(z), generator=gen, device=gen.device).split(batch_size):
        if len(batch) >= 2:
            train_step(decoder, optimizer, z[batch], x[batch])


def train_step(decoder: nn.Module, optimizer: torch.optim.Optimizer, z: torch.Tensor, x: torch.Tensor) -> None:
    """One Adam step on the batch's reconstruction MSE."""
    optimizer.zero_grad()
    (decoder(z) - x).pow(2).mean().backward()
    optimizer.step()


@torch.no_grad()
def decode(decoder: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """The decoder's reconstructions in eval mode, in batches."""
    decoder.eval()
    return torch.cat([decoder(chunk) for chunk in z.split(decode_batch(decoder.input_shape))])
