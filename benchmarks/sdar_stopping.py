"""SDAR's early stopping on the attacker's own signal against the fixed iteration budget.

The attacker cannot see the targets; it can hold a slice of its aux data out of training and
watch the MSE of reconstructing it through its simulator f~ and decoder (attacks/sdar.py,
option early_stopping). For every seed this runs

- the fixed budget: the attack without early stopping, every aux sample in training, `--iterations` iterations;
- one recording run with the held-out slice out of training, measuring the held-out aux MSE
  (the attacker's signal) and the target MSE (what the attacker cannot see) every `--every`
  iterations and never stopping. Stopping does not change the training before the stop (the
  measurement has its own noise draw and runs in eval mode), so replaying the stopping rule
  on the recorded signal gives what the stopped attack returns for every (every k, patience):
  the target MSE where it stops, beside the fixed budget's mean and spread between seeds.

    python -m benchmarks.sdar_stopping                                   # digits CNN with g, seeds 0-2
    python -m benchmarks.sdar_stopping --model breast_cancer_mlp         # tabular, with g
    python -m benchmarks.sdar_stopping --architecture resnet --size 32 --width 16 --iterations 2500
    python -m benchmarks.sdar_stopping --onnx stem.onnx --aux data.npz --iterations 2500 --same-data \
        --seeds 0 --save 'seed{seed}.json'                                   # a model file, as `splitaudit run` loads it
    python -m benchmarks.sdar_stopping --replay seed0.json seed1.json   # the table from saved recordings

`--architecture` audits a stem of tests/support/architectures.py (random weights, trained-looking batch
norm) on generated smooth class-coloured images (benchmarks/audit_scale.py's data), without a
top model (the cpu preset's budget is then 2500 iterations).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import tempfile
import time
from importlib.resources import files
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchmarks.audit_scale import smooth_images
from benchmarks.sdar_curve import DATA, curve
from splitaudit.attacks.parts import sdar_training
from splitaudit.attacks.parts.reconstruction import mean_guess_baseline, reconstruction_metrics
from splitaudit.attacks.parts.sdar_training import FULL, PRECISIONS, sdar_reconstruct, training_precision
from splitaudit.attacks.sdar import PRESETS
from splitaudit.core.config import AuditOptions
from splitaudit.core.plateau import Plateau
from splitaudit.engine.pipeline import prepare_context
from tests.support.architectures import ARCHITECTURES, build

EVERY_CHOICES = (1, 2, 4)  # evaluation intervals replayed, in multiples of --every
PATIENCE_CHOICES = (2, 3, 4, 6, 8)


def context(args, folder: Path):
    """The audit context: a bundled sample model with its top model, an architecture stem on
    generated images, or (`args.shape`, where the script has it) shapes_scale.py's bottom and data, no g."""
    if getattr(args, "onnx", None):
        options = AuditOptions(model=args.onnx, aux=args.aux, seed=0)
        return prepare_context(options.validate()), f"{Path(args.onnx).name} on {Path(args.aux).name}, no g"
    if getattr(args, "shape", None):
        from benchmarks.shapes_scale import write_inputs

        model, aux, target = write_inputs(folder, args.shape, args.samples, args.samples // 2)
        options = AuditOptions(model=str(model), aux=str(aux), target=str(target), seed=0)
        return prepare_context(options.validate()), f"{args.shape} (shapes_scale.py's bottom), no g"
    if not args.architecture:
        samples = files("splitaudit.sample_models")
        options = AuditOptions(
            model=str(samples / f"{args.model}.onnx"),
            aux=str(samples / DATA.get(args.model, "digits.npz")),
            top_model=str(samples / f"{args.model}_top.pt"),
            seed=0,
            quick=True,
        )
        return prepare_context(options.validate()), f"{args.model} with g"
    x, y, attr = smooth_images(args.samples, args.size)
    np.savez(folder / "data.npz", x=x, y=y, attr=attr)
    model = build(args.architecture, seed=0, image_size=args.size, width=args.width)
    options = AuditOptions(model=model, aux=str(folder / "data.npz"), input_shape=[3, args.size, args.size], seed=0)
    name = f"{args.architecture} stem width {args.width} at 3x{args.size}x{args.size}, {args.samples} samples, no g"
    return prepare_context(options.validate()), name


def fixed_budget(ctx, seed: int, iterations: int, preset: dict, precision: str) -> tuple[float, float]:
    """(target MSE, seconds) of the attack at the fixed budget: every aux sample trains, no early stopping."""
    observed = ctx.observed_embeddings("target", ctx.generator(seed))
    start = time.perf_counter()
    x_hat, *_ = sdar_reconstruct(
        ctx,
        observed,
        ctx.target.y,
        seed,
        iterations,
        preset["batch_size"],
        FULL,
        simulator_init=preset["simulator_init"],
        lr_scale=preset["lr_scale"],
        server_part="classifier" if ctx.top_model is not None else "none",
        precision=precision,
    )
    return reconstruction_metrics(ctx.target.x, x_hat, ctx.space)["mse"], time.perf_counter() - start


def replay(points: list, every: int, k: int, patience: int, min_improvement: float = 0.0) -> tuple[int, float, float]:
    """(iteration where the rule stops, target MSE there, target MSE at the best held-out point),
    the rule replayed with the attack's own Plateau on a recorded run (at the cap: the last point)."""
    plateau = Plateau(patience, min_improvement)
    for row, point in enumerate(points):
        step = (row + 1) * every
        if step % k == 0 and plateau.update(step, point.holdout_mse):
            break
    stop = plateau.last_step if plateau.stopped else len(points) * every
    return stop, points[stop // every - 1].mse, points[plateau.best_step // every - 1].mse


def save_recording(path: Path, seed: int, every: int, fixed: float, points: list) -> None:
    """The recording as JSON (target and held-out MSE per measurement), for --replay: recordings of
    seeds run in separate processes side by side, replayed together."""
    rows = [{"iteration": p.iteration, "mse": p.mse, "holdout_mse": p.holdout_mse} for p in points]
    path.write_text(json.dumps({"seed": seed, "every": every, "fixed": fixed, "points": rows}))


def replay_saved(paths: list[str], gains: list[float]) -> None:
    """The table of saved recordings (every one measured at the same interval)."""
    saved = [json.loads(Path(path).read_text()) for path in paths]
    every = saved[0]["every"]
    if any(run["every"] != every for run in saved):
        raise SystemExit("the recordings were measured at different intervals")
    recorded = [[SimpleNamespace(**row) for row in run["points"]] for run in saved]
    cap = recorded[0][-1].iteration
    seeds = [run["seed"] for run in saved]
    print_table([run["fixed"] for run in saved], recorded, every, f"{cap} iterations", seeds, gains)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="digits_cnn", help="a bundled sample model's name (with its g)")
    parser.add_argument("--architecture", choices=list(ARCHITECTURES), help="a stem instead of a sample model")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--iterations", type=int, default=1500, help="the cap (the cpu preset's: 1500 with g)")
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--holdout", type=float, default=0.1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--same-data",
        action="store_true",
        help="compare with the recording at the cap instead of running the fixed budget (half the time)",
    )
    parser.add_argument(
        "--contiguous", action="store_true", help="SDAR's networks in the contiguous layout (before channels_last)"
    )
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="auto", help="the training steps' arithmetic (the attack's option)"
    )
    parser.add_argument("--onnx", help="a bottom model file (ONNX or TorchScript) instead of a sample model")
    parser.add_argument("--aux", help="its aux data (with --onnx)")
    parser.add_argument(
        "--save", help="write each seed's recording to this JSON file ({seed} in the name: one file per seed)"
    )
    parser.add_argument("--replay", nargs="+", help="print the table of recordings saved with --save, then stop")
    parser.add_argument(
        "--gains",
        type=float,
        nargs="+",
        default=[0.0],
        help="least relative improvement of the held-out MSE that resets the patience, each replayed (default 0)",
    )
    args = parser.parse_args()
    if args.replay:
        replay_saved(args.replay, args.gains)
        return
    sdar_training.CHANNELS_LAST = not args.contiguous
    preset = PRESETS["cpu"]
    with tempfile.TemporaryDirectory() as tmp:
        ctx, name = context(args, Path(tmp))
        part = "classifier" if ctx.top_model is not None else "none"
        base = mean_guess_baseline(ctx.aux.x, ctx.target.x, ctx.space)["mse"]
        layout = "contiguous" if args.contiguous else "channels_last"
        precision = training_precision(args.precision, ctx.device, math.prod(ctx.encoder.input_shape))
        print(
            f"{name}; cpu preset, cap {args.iterations}, holdout {args.holdout}, {layout}, {precision}; "
            f"mean-guess MSE {base:.4f}"
        )
        fixed, recorded = [], []
        for seed in args.seeds:
            start = time.perf_counter()
            points = curve(
                ctx,
                FULL,
                seed,
                args.iterations,
                args.every,
                preset,
                "known",
                f"seed {seed}",
                args.holdout,
                server_part=part,
                precision=precision,
            )
            recorded.append(points)
            words = f"with the hold-out, at the cap {points[-1].mse:.4f} ({time.perf_counter() - start:.0f} s)"
            if args.same_data:
                fixed.append(points[-1].mse)
            else:
                mse, seconds = fixed_budget(ctx, seed, args.iterations, preset, precision)
                fixed.append(mse)
                words = f"fixed budget {mse:.4f} ({seconds:.0f} s); {words}"
            print(f"seed {seed}: {words}", flush=True)
            if args.save:
                save_recording(Path(args.save.format(seed=seed)), seed, args.every, fixed[-1], points)
    reference = "the recording at the cap (aux less the hold-out)" if args.same_data else "all aux"
    print_table(fixed, recorded, args.every, f"{args.iterations} iterations, {reference}", args.seeds, args.gains)


def print_table(
    fixed: list[float], recorded: list[list], every: int, reference: str, seeds: list[int], gains: list[float]
) -> None:
    """The fixed budget's mean and spread, then every replayed (every, patience, least relative
    gain that counts as an improvement): where it stops and the target MSE."""
    spread = statistics.pstdev(fixed)
    print(
        f"\nfixed budget ({reference}): target MSE {statistics.mean(fixed):.4f} "
        f"± {spread:.4f} (std over seeds {seeds}); load average {os.getloadavg()[0]:.1f}"
    )
    header = f"{'every':>6} {'patience':>8} {'gain':>5} {'stops at (per seed)':>22} {'target MSE':>10} {'at best':>8}"
    print(header + f" {'vs fixed':>9}")
    for k, patience, gain in itertools.product((m * every for m in EVERY_CHOICES), PATIENCE_CHOICES, gains):
        runs = [replay(points, every, k, patience, gain) for points in recorded]
        stops = "/".join(str(stop) for stop, _, _ in runs)
        mse, at_best = statistics.mean(r[1] for r in runs), statistics.mean(r[2] for r in runs)
        gap = (at_best - statistics.mean(fixed)) / spread if spread else float("nan")
        print(f"{k:>6} {patience:>8} {gain:>5.2f} {stops:>22} {mse:>10.4f} {at_best:>8.4f} {gap:>+8.1f}σ")


if __name__ == "__main__":
    main()
