"""SDAR's target MSE against training iterations, with and without d1 (the paper's ablation).

Reproduces the learning curves behind SDAR's default iteration counts and the ablation test
(attacks/sdar.py, tests/test_sdar.py): on a bundled sample model, trains the attack from the
same seed with every regulariser and without d1, and prints the MSE of its reconstructions of
the target data every `--every` iterations, beside the mean-guess baseline. The target MSE is
what the attacker cannot see; this script is a measurement, not part of the attack.

    python benchmarks/sdar_curve.py                          # digits CNN without g, 2500 iterations
    python benchmarks/sdar_curve.py --top-model --iterations 1500 --seed 1
    python benchmarks/sdar_curve.py --top-model --preset paper --iterations 2000 --batch-size 32
    python benchmarks/sdar_curve.py --model breast_cancer_mlp --top-model
"""

from __future__ import annotations

import argparse
from importlib.resources import files

from splitaudit.attacks.reconstruction import mean_guess_baseline, reconstruction_metrics
from splitaudit.attacks.sdar import ABLATIONS, FULL, PRESETS, SDARNets, sdar_reconstruct
from splitaudit.config import AuditOptions
from splitaudit.pipeline import prepare_context

DATA = {"breast_cancer_mlp": "breast_cancer.npz"}  # every other sample model uses digits.npz
VARIANTS = {"full": FULL, "no d1": ABLATIONS["mse_no_d1"]}


def curve(ctx, regularizers, seed: int, iterations: int, every: int, preset: dict, label: str = "") -> list[float]:
    """Target MSE every `every` iterations of one SDAR run (the attack's own training)."""
    observed = ctx.observed_embeddings("target", ctx.generator(seed))
    target = ctx.target
    mses = []

    def measure(i: int, nets: SDARNets) -> None:
        if i % every == 0:
            x_hat, _ = nets.decode(observed)
            nets.decoder.train()
            mses.append(reconstruction_metrics(target.x, x_hat, target.is_image)["mse"])
            print(f"  {label} iteration {i}: target MSE {mses[-1]:.4f}", flush=True)

    sdar_reconstruct(
        ctx,
        observed,
        target.y,
        seed,
        iterations,
        preset["batch_size"],
        regularizers,
        measure,
        simulator_init=preset["simulator_init"],
        lr_scale=preset["lr_scale"],
    )
    return mses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="digits_cnn", help="a bundled sample model's name")
    parser.add_argument("--top-model", action="store_true", help="give the attacker the model's g")
    parser.add_argument("--iterations", type=int, default=2500)
    parser.add_argument("--preset", choices=list(PRESETS), default="cpu", help="learning rates, init and batch")
    parser.add_argument("--batch-size", type=int, help="default: the preset's")
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--variant",
        default="both",
        choices=["both", *VARIANTS],
        help="one variant only (run two processes side by side on a shared CPU)",
    )
    args = parser.parse_args()
    samples = files("splitaudit.sample_models")
    options = AuditOptions(
        model=str(samples / f"{args.model}.onnx"),
        aux=str(samples / DATA.get(args.model, "digits.npz")),
        top_model=str(samples / f"{args.model}_top.pt") if args.top_model else None,
        seed=0,
        quick=True,
    ).validate()
    ctx = prepare_context(options)
    preset = {**PRESETS[args.preset], **({"batch_size": args.batch_size} if args.batch_size else {})}
    baseline = mean_guess_baseline(ctx.aux.x, ctx.target.x, ctx.target.is_image)["mse"]
    print(
        f"{args.model}, {'with' if args.top_model else 'without'} g, seed {args.seed}, targets' labels, "
        f"preset {args.preset} (learning rates x{preset['lr_scale']:g}, batch {preset['batch_size']}); "
        f"mean-guess MSE {baseline:.4f}"
    )
    variants = VARIANTS if args.variant == "both" else {args.variant: VARIANTS[args.variant]}
    curves = {
        name: curve(ctx, regs, args.seed, args.iterations, args.every, preset, name) for name, regs in variants.items()
    }
    if len(curves) == 1:
        return
    print(f"{'iteration':>9}  " + "  ".join(f"{name:>8}" for name in curves) + "  no d1 / full")
    for row, step in enumerate(range(args.every, args.iterations + 1, args.every)):
        full, no_d1 = curves["full"][row], curves["no d1"][row]
        print(f"{step:>9}  {full:8.4f}  {no_d1:8.4f}  {no_d1 / full:12.2f}")


if __name__ == "__main__":
    main()
