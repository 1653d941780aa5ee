"""SDAR's target MSE against training iterations, with and without d1 (the paper's ablation).

Reproduces the learning curves behind SDAR's default iteration counts and the ablation test
(attacks/sdar.py, tests/test_sdar.py): on a bundled sample model, trains the attack from the
same seed with every regulariser and without d1, and prints the MSE of its reconstructions of
the target data every `--every` iterations, beside the mean-guess baseline. The target MSE is
what the attacker cannot see; this script is a measurement, not part of the attack.

    python -m benchmarks.sdar_curve                          # digits CNN without g, 2500 iterations
    python -m benchmarks.sdar_curve --top-model --iterations 1500 --seed 1
    python -m benchmarks.sdar_curve --top-model --preset paper --iterations 2000 --batch-size 32
    python -m benchmarks.sdar_curve --model breast_cancer_mlp --top-model

U-shaped SL (`--labels inferred`, Zhu et al., NDSS 2025, Sec. IV-B): the label accuracy of the
inferred target labels is printed beside the MSE (majority-class baseline). `--body` gives the
attacker only the server's body g: for the bundled digits CNN the first layer (linear + GELU)
of its top model, whose last linear layer is the client's tail h; `--u-shaped ARCH` trains a
U-shaped model of tests/support/ushaped.py on the target data (with `--top-model`, the attacker gets its g).

    python -m benchmarks.sdar_curve --labels inferred --variant full           # no g at all
    python -m benchmarks.sdar_curve --labels inferred --variant full --top-model --body
    python -m benchmarks.sdar_curve --labels inferred --variant full --u-shaped flat_ln --top-model
"""

from __future__ import annotations

import argparse
import dataclasses
from importlib.resources import files

import torch
import torch.nn as nn

from splitaudit.attacks.parts.reconstruction import mean_guess_baseline, reconstruction_metrics
from splitaudit.attacks.parts.sdar_training import ABLATIONS, FULL, SDARNets, Stopping, bce, sdar_reconstruct
from splitaudit.attacks.sdar import (
    LABEL_FLIP,
    PRESETS,
    conditioning_labels,
    majority_class_accuracy,
    relabelled_accuracy,
)
from splitaudit.core.config import AuditOptions
from splitaudit.engine.pipeline import prepare_context
from tests.support.ushaped import ARCHITECTURES, train_u_shaped

DATA = {"breast_cancer_mlp": "breast_cancer.npz"}  # every other sample model uses digits.npz
VARIANTS = {"full": FULL, "no d1": ABLATIONS["mse_no_d1"]}


@dataclasses.dataclass
class Point:
    """One measurement of a run: what the attacker cannot see (target MSE, label accuracies) and the
    signals it can (d1's loss on all aux and target embeddings; the simulator's task loss)."""

    iteration: int
    mse: float
    accuracy: float | None
    relabelled: float | None
    labels: torch.Tensor
    d1_loss: float | None
    task_loss: float
    holdout_mse: float | None = None  # the attacker's own stopping signal, with --holdout


@torch.no_grad()
def d1_loss(ctx, nets: SDARNets, observed: torch.Tensor) -> float | None:
    """d1's loss (Eq. 2) on all aux and target embeddings, networks in eval mode: how well f~'s
    embeddings pass for f's at the end of training (an attacker-observable signal; higher: closer)."""
    if nets.d1 is None:
        return None
    nets.simulator.eval(), nets.d1.eval()
    z_aux = ctx.add_noise(nets.simulator(ctx.aux.x), ctx.generator(0))
    index = torch.arange(len(observed), device=observed.device)
    c_aux, c_target = nets.condition(ctx.aux.y), nets.condition(nets.target_labels(observed, index))
    loss = bce(nets.d1(z_aux, c_aux), 0.0) + bce(nets.d1(observed, c_target), 1.0)
    nets.simulator.train(), nets.d1.train()
    return float(loss)


def curve(
    ctx,
    regularizers,
    seed: int,
    iterations: int,
    every: int,
    preset: dict,
    source: str,
    label: str = "",
    holdout: float = 0.0,
    **options,
) -> list:
    """A Point every `every` iterations of one SDAR run (the attack's own training) whose target
    labels come from `source` (sdar's option `labels`). `holdout`: the share of aux held out of
    training for the attacker's own signal (recorded at every point, never stopping). `options` go
    to sdar_reconstruct."""
    observed = ctx.observed_embeddings("target", ctx.generator(seed))
    target = ctx.target
    conditioning, naming = conditioning_labels(ctx, source, observed, seed)
    if naming:
        print(f"  clusters named by the class layout: layout agreement {naming['layout_agreement']:.3f}")
    points = []

    def measure(i: int, nets: SDARNets) -> None:
        if i % every == 0:
            x_hat, labels = nets.decode(observed)
            nets.decoder.train()
            mse = reconstruction_metrics(target.x, x_hat, ctx.space)["mse"]
            accuracy = relabelled = None
            task_loss = float(torch.stack(nets.task_losses[-every:]).mean())
            discriminated = d1_loss(ctx, nets, observed)
            words = f", task loss {task_loss:.3f}" + ("" if discriminated is None else f", d1 loss {discriminated:.3f}")
            if source != "known":
                accuracy = float((labels == target.y).float().mean())
                relabelled = relabelled_accuracy(labels, target.y)
                words += f", label accuracy {accuracy:.3f} ({relabelled:.3f} under the best renaming of classes)"
            points.append(Point(i, mse, accuracy, relabelled, labels, discriminated, task_loss))
            print(f"  {label} iteration {i}: target MSE {mse:.4f}{words}", flush=True)

    recording = Stopping(every, patience=iterations + 1, holdout_fraction=holdout) if holdout else None
    _, _, _, signal, _ = sdar_reconstruct(
        ctx,
        observed,
        conditioning,
        seed,
        iterations,
        preset["batch_size"],
        regularizers,
        measure,
        simulator_init=preset["simulator_init"],
        lr_scale=preset["lr_scale"],
        stopping=recording,
        **options,
    )
    held = [value for _, value in signal.history] if signal else [None] * len(points)
    return [dataclasses.replace(point, holdout_mse=value) for point, value in zip(points, held)]


def bundled_body(path: str) -> nn.Module:
    """The server's body g of a bundled top model mlp([128, 64, 10]): its linear layer + GELU (the
    last linear layer is the client's tail h in the U-shaped split)."""
    weights = torch.jit.load(path).state_dict()
    body = nn.Sequential(nn.Linear(128, 64), nn.GELU())
    body[0].load_state_dict({"weight": weights["0.weight"], "bias": weights["0.bias"]})
    return body.eval()


def u_shaped_context(arch: str, aux: str, epochs: int, with_body: bool):
    """A context whose bottom model is f of a tests/support/ushaped.py model trained on the target data, and
    whose top model is its body g (`with_body`); prints the model's accuracy."""
    reference = prepare_context(
        AuditOptions(
            model=str(files("splitaudit.sample_models") / "digits_cnn.onnx"), aux=aux, seed=0, quick=True
        ).validate()
    )
    f, g, _, accuracy = train_u_shaped(arch, reference.target.x, reference.target.y)
    print(f"{arch}: U-shaped model trained on the target data, accuracy {accuracy:.3f}")
    return prepare_context(
        AuditOptions(model=f, aux=aux, top_model=g if with_body else None, seed=0, quick=True).validate()
    )


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
    parser.add_argument(
        "--labels", choices=["known", "inferred", "clustered"], default="known", help="inferred, clustered: U-shaped SL"
    )
    parser.add_argument("--body", action="store_true", help="the top model's first layer only, as the body g")
    parser.add_argument("--u-shaped", choices=ARCHITECTURES, help="a U-shaped model of tests/support/ushaped.py")
    parser.add_argument("--label-flip", type=float, default=LABEL_FLIP, help="U-shaped label flips")
    parser.add_argument(
        "--holdout", type=float, default=0.0, help="share of aux held out for the attacker's own signal (0: none)"
    )
    args = parser.parse_args()
    samples = files("splitaudit.sample_models")
    aux = str(samples / DATA.get(args.model, "digits.npz"))
    if args.u_shaped:
        ctx = u_shaped_context(args.u_shaped, aux, epochs=40, with_body=args.top_model)
    else:
        top = str(samples / f"{args.model}_top.pt") if args.top_model else None
        options = AuditOptions(model=str(samples / f"{args.model}.onnx"), aux=aux, top_model=top, seed=0, quick=True)
        ctx = prepare_context(options.validate())
        if args.body:
            ctx = dataclasses.replace(ctx, top_model=bundled_body(top))
    preset = {**PRESETS[args.preset], **({"batch_size": args.batch_size} if args.batch_size else {})}
    baseline = mean_guess_baseline(ctx.aux.x, ctx.target.x, ctx.space)["mse"]
    inferred = args.labels != "known"
    part = "none" if not args.top_model else ("body" if args.body or args.u_shaped else "classifier")
    how = f"inferred (label flips {args.label_flip})" if args.labels == "inferred" else "clustered"
    labels = (
        f"labels {how}, majority baseline {majority_class_accuracy(ctx.aux.y, ctx.target.y):.3f}"
        if inferred
        else "targets' labels"
    )
    print(
        f"{args.u_shaped or args.model}, g: {part}, seed {args.seed}, {labels}, "
        f"preset {args.preset} (learning rates x{preset['lr_scale']:g}, batch {preset['batch_size']}); "
        f"mean-guess MSE {baseline:.4f}"
    )
    options = {"server_part": part}
    if args.labels == "inferred":
        options.update(conditional=False, label_flip=args.label_flip)
    variants = VARIANTS if args.variant == "both" else {args.variant: VARIANTS[args.variant]}
    curves = {
        name: curve(
            ctx, regs, args.seed, args.iterations, args.every, preset, args.labels, name, args.holdout, **options
        )
        for name, regs in variants.items()
    }
    if args.holdout:
        print(f"{'iteration':>9}  {'target MSE':>10}  {'held-out aux MSE':>16}  ({next(iter(curves))})")
        for point in next(iter(curves.values())):
            print(f"{point.iteration:>9}  {point.mse:>10.4f}  {point.holdout_mse:>16.4f}")
    if len(curves) == 1:
        return
    print(f"{'iteration':>9}  " + "  ".join(f"{name:>8}" for name in curves) + "  no d1 / full")
    for row, step in enumerate(range(args.every, args.iterations + 1, args.every)):
        full, no_d1 = curves["full"][row].mse, curves["no d1"][row].mse
        print(f"{step:>9}  {full:8.4f}  {no_d1:8.4f}  {no_d1 / full:12.2f}")


if __name__ == "__main__":
    main()
