"""The decoder attack's learning curve, and where patience rules would stop it.

Trains the attack's own decoder (attacks/decoder.py: its network, optimiser, batches and fresh noise
per epoch) for the full epoch cap without stopping, and records every epoch the hold-out aux MSE
(the signal its early stopping watches; the attacker can measure it) and the target MSE (which it
cannot). Then it replays the stopping rule for patience floors of several sizes in optimiser steps
(`epochs_of_patience`) on the recording, per seed: where it stops, its best epoch, and the target
MSE of the restored best state, which is what the attack reports.

    python -m benchmarks.decoder_curve MODEL AUX [--noise-sigma S] [--seeds 0 1 2] [--samples N]

--samples N keeps the first N samples of AUX (split 50/50 into aux and targets, as the audit does).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tempfile
from pathlib import Path

import numpy as np
import torch

from splitaudit.attacks import decoder as attack
from splitaudit.core.config import AuditOptions
from splitaudit.core.plateau import Plateau, epochs_of_patience, steps_per_epoch
from splitaudit.engine.pipeline import prepare_context

FLOORS = (0, 50, 100, 150, 200, 300)  # patience floors in optimiser steps


def recorded_curve(ctx, seed: int, opts: attack.DecoderOptions) -> list[tuple[int, float, float]]:
    """(epoch, hold-out MSE, target MSE) every epoch up to the cap: the attack's own training, its
    patience set past the cap so that it never stops early."""
    targets = ctx.observed_embeddings("target", torch.Generator(device=ctx.device).manual_seed(10_000 + seed))
    rows = []

    def record(epoch: int, heldout: float, decoder) -> None:
        rows.append((epoch, heldout, float((attack.decode(decoder, targets) - ctx.target.x).pow(2).mean())))

    never = dataclasses.replace(opts, patience=opts.epochs + 1, patience_steps=0)
    attack.train_decoder(ctx, seed, ctx.generator(seed), never, on_epoch=record)
    return rows


def replay(rows: list[tuple[int, float, float]], patience: int) -> tuple[int, int, float]:
    """(stopped at, best epoch, target MSE at the best epoch) under the attack's Plateau rule."""
    plateau = Plateau(patience)
    for epoch, heldout, target in rows:
        if plateau.update(epoch, heldout, lambda target=target: target):
            break
    return plateau.last_step, plateau.best_step, plateau.best_state


def first_samples(path: str, n: int | None) -> str:
    """AUX itself, or a temporary copy of its first n samples (every array cut alike)."""
    if n is None:
        return path
    data = np.load(path)
    copy = Path(tempfile.mkdtemp()) / "first.npz"
    np.savez(copy, **{key: data[key][:n] for key in data.files})
    return str(copy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("aux")
    parser.add_argument("--noise-sigma", type=float, default=0.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--samples", type=int, default=None)
    args = parser.parse_args()
    options = AuditOptions(model=args.model, aux=first_samples(args.aux, args.samples), noise_sigma=args.noise_sigma)
    ctx = prepare_context(options.validate())
    opts = attack.DecoderOptions()
    curves = [recorded_curve(ctx, seed, opts) for seed in args.seeds]
    n_train = len(ctx.aux) - max(1, math.ceil(opts.holdout_fraction * len(ctx.aux)))
    steps = steps_per_epoch(n_train, opts.batch_size)
    guess = float((ctx.aux.x.mean(0, keepdim=True) - ctx.target.x).pow(2).mean())
    print(f"{args.model}: {n_train} training samples, {steps} steps an epoch, mean guess {guess:.4g}")
    print("target MSE at the cap:", " / ".join(f"{rows[-1][2]:.4g}" for rows in curves))
    for floor in FLOORS:
        patience = epochs_of_patience(opts.patience, steps, floor)
        stops = [replay(rows, patience) for rows in curves]
        print(
            f"floor {floor:3d} steps, patience {patience:3d} epochs: stops {'/'.join(str(s[0]) for s in stops)}, "
            f"best {'/'.join(str(s[1]) for s in stops)}, target MSE {' / '.join(f'{s[2]:.4g}' for s in stops)}, "
            f"mean {np.mean([s[2] for s in stops]):.4g}"
        )


if __name__ == "__main__":
    main()
