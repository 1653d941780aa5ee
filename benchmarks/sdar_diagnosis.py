"""Where SDAR's signal dies on a bottom model: controls beside the attack's own training.

On shapes_scale.py's inputs (the MobileNetV3-style text-line bottom 3x48x192 -> 16x3x96, trained
briefly, 400 aux / 200 target lines; or the 1-D audio bottom), with the attack's own networks,
training step and cpu preset (no g, the targets' labels known, a tenth of aux held out), it runs

- `oracle`: SDAR's decoder and d2 (the same networks and decoder step, `decoder_step`) trained on
  the real bottom's aux embeddings f(x_aux) instead of the simulator's: if it beats the mean guess
  on the targets, the decoder is able and the simulator f~ is the bottleneck;
- `full` and `no_d1`: the attack itself, and without d1 (the only tie of f~ to f without g);
- `regress`: the simulator as the attack builds it (f's architecture re-initialised, its folded
  batch norm restored) regressed onto f's aux embeddings (MSE, Adam at the attack's simulator
  rate): the share of f(x_target)'s variance it explains says how close f~ gets to f even when
  told f's outputs, which no attacker is.

Every `--every` iterations each prints one line: the target MSE (what the attacker cannot see);
the held-out aux MSE through f~ and the decoder (the attacker's signal); "f~ targets": the target
inputs decoded from f~'s embeddings of them (how well the decoder inverts f~ itself, off aux);
"spread": the per-pixel variance of the reconstructions over samples against the targets' own
(near 0: collapse to the mean line); the simulator's task loss; d1's loss on all aux and target
embeddings (eval mode; log 4 = 1.39 when d1 cannot tell them apart); "moments": the gap between
f~(x_aux)'s and f(x_target)'s per-channel means and standard deviations, in units of f's standard
deviation; "ridge R2": how much of f(x) a ridge map from f~(x) explains on the targets (fitted on
aux), printed first from the pixels and from the untrained f~ as references (on the text line at
400 aux all three are near or below 0: the probe is uninformative there). `--nets` prints the networks
the attack builds for the shapes (each layer's output shape), then stops.

    nice python -m benchmarks.sdar_diagnosis --controls oracle full no_d1 --iterations 300
    python -m benchmarks.sdar_diagnosis --nets
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

import torch

from benchmarks.sdar_curve import d1_loss
from benchmarks.shapes_scale import SHAPES, cpu_seconds, write_inputs
from splitaudit.attacks.parts.nets import decode_batch
from splitaudit.attacks.parts.reconstruction import mean_guess_baseline
from splitaudit.attacks.parts.sdar_training import (
    ABLATIONS,
    FULL,
    HOLDOUT_STREAM,
    TRAINING_STREAM,
    BatchStream,
    SDARNets,
    Stopping,
    decoder_step,
    sdar_reconstruct,
)
from splitaudit.attacks.sdar import PRESETS
from splitaudit.core.config import AuditOptions
from splitaudit.core.plateau import evaluating
from splitaudit.core.threads import threads_for
from splitaudit.engine.pipeline import prepare_context

PRESET = PRESETS["cpu"]
HOLDOUT = 0.1
RIDGE = 1e-3  # ridge penalty, relative to the mean squared feature


def split(ctx, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(held-out, training) aux indices, the attack's own split (sdar_training)."""
    order = torch.randperm(len(ctx.aux), generator=ctx.generator(seed + HOLDOUT_STREAM))
    n = math.ceil(HOLDOUT * len(order))
    return order[:n], order[n:]


@torch.no_grad()
def decoded(nets: SDARNets, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    batch = decode_batch(nets.decoder.input_shape)
    with evaluating(nets.decoder):
        return torch.cat([nets.decoder(zs, nets.condition(ys)) for zs, ys in zip(z.split(batch), y.split(batch))])


@torch.no_grad()
def simulated(nets: SDARNets, x: torch.Tensor) -> torch.Tensor:
    with evaluating(nets.simulator):
        return torch.cat([nets.simulator(xs) for xs in x.split(64)])


def spread(x: torch.Tensor) -> float:
    """Per-pixel variance over samples, averaged over pixels."""
    return float(x.var(dim=0).mean())


def moment_gap(z_sim: torch.Tensor, z_real: torch.Tensor) -> tuple[float, float]:
    """(mean gap, std gap) of per-channel statistics, in units of the real embeddings' overall std."""
    dims = [0] + list(range(2, z_real.dim()))
    scale = float(z_real.std())
    mean_gap = float((z_sim.mean(dims) - z_real.mean(dims)).pow(2).mean().sqrt()) / scale
    std_gap = float((z_sim.std(dims) - z_real.std(dims)).pow(2).mean().sqrt()) / scale
    return mean_gap, std_gap


def ridge_r2(train_in, train_out, test_in, test_out) -> float:
    """R2 on the test pair of a ridge map (dual form: few samples, many features) fitted on the train pair."""
    a, b = train_in.flatten(1).double(), train_out.flatten(1).double()
    mu_a, mu_b = a.mean(0), b.mean(0)
    a, b = a - mu_a, b - mu_b
    gram = a @ a.T
    alpha = torch.linalg.solve(gram + RIDGE * float(gram.diagonal().mean()) * torch.eye(len(a), dtype=a.dtype), b)
    predicted = (test_in.flatten(1).double() - mu_a) @ (a.T @ alpha) + mu_b
    truth = test_out.flatten(1).double()
    return float(1 - (predicted - truth).pow(2).sum() / (truth - truth.mean(0)).pow(2).sum())


def report(label: str, i: int, ctx, nets: SDARNets, holdout: torch.Tensor, oracle: bool, start: float) -> None:
    """One line of measurements of a run at iteration i."""
    target, aux = ctx.target, ctx.aux
    f_target, f_aux = ctx.clean_embeddings("target"), ctx.clean_embeddings("aux")
    x_hat = decoded(nets, f_target, target.y)
    mse = float((x_hat - target.x).pow(2).mean())
    words = f"target MSE {mse:.4f}, spread {spread(x_hat) / spread(target.x):.2f}"
    if oracle:
        held = decoded(nets, f_aux[holdout], aux.y[holdout])
        words += f", held-out aux MSE (f) {float((held - aux.x[holdout]).pow(2).mean()):.4f}"
    else:
        sim_aux, sim_target = simulated(nets, aux.x), simulated(nets, target.x)
        held = decoded(nets, sim_aux[holdout], aux.y[holdout])
        own = decoded(nets, sim_target, target.y)
        task = float(torch.stack(nets.task_losses[-50:]).mean())
        d1 = d1_loss(ctx, nets, ctx.observed_embeddings("target", ctx.generator(0)))
        mean_gap, std_gap = moment_gap(sim_aux, f_target)
        words += (
            f", held-out aux MSE {float((held - aux.x[holdout]).pow(2).mean()):.4f}"
            f", f~ targets MSE {float((own - target.x).pow(2).mean()):.4f}, task loss {task:.3f}"
            + ("" if d1 is None else f", d1 loss {d1:.3f}")
            + f", moments {mean_gap:.2f}/{std_gap:.2f}, ridge R2 {ridge_r2(sim_aux, f_aux, sim_target, f_target):.3f}"
        )
    print(f"  {label} {i}: {words}; {cpu_seconds() - start:.0f} CPU s", flush=True)


def calibrate(ctx, seed: int) -> None:
    """The ridge R2 of f(x) on the targets from two references: the input pixels, and the simulator
    as built (re-initialised, before any training)."""
    f_aux, f_target = ctx.clean_embeddings("aux"), ctx.clean_embeddings("target")
    fresh = SDARNets.build(ctx, seed, FULL, ctx.target.y, server_part="none")
    pixels = ridge_r2(ctx.aux.x, f_aux, ctx.target.x, f_target)
    untrained = ridge_r2(simulated(fresh, ctx.aux.x), f_aux, simulated(fresh, ctx.target.x), f_target)
    print(f"  ridge R2 of f(x) on the targets from the pixels {pixels:.3f}, from the untrained f~ {untrained:.3f}")


def oracle_run(ctx, seed: int, iterations: int, every: int) -> None:
    """SDAR's decoder and d2, each step the attack's decoder_step, fed f's own aux embeddings."""
    holdout, train = split(ctx, seed)
    f_aux, observed = ctx.clean_embeddings("aux"), ctx.observed_embeddings("target", ctx.generator(seed))
    start = cpu_seconds()
    with threads_for(ctx.aux.x.numel(), ctx.device):
        nets = SDARNets.build(ctx, seed, FULL, ctx.target.y, lr_scale=PRESET["lr_scale"], server_part="none")
        gen = ctx.generator(seed + TRAINING_STREAM)
        aux_stream, target_stream = (
            BatchStream(len(train), PRESET["batch_size"], gen, train),
            BatchStream(len(observed), PRESET["batch_size"], gen),
        )
        for i in range(1, iterations + 1):
            pick, pick_target = aux_stream.next(), target_stream.next()
            x_aux, y_aux = ctx.aux.x[pick], ctx.aux.y[pick]
            c_target = nets.condition(ctx.target.y[pick_target])
            z_aux = ctx.add_noise(f_aux[pick], gen)
            decoder_step(nets, x_aux, z_aux, nets.condition(y_aux), observed[pick_target], c_target)
            if i % every == 0:
                report("oracle", i, ctx, nets, holdout, oracle=True, start=start)


def regress_run(ctx, seed: int, iterations: int, every: int) -> None:
    """The attack's simulator fitted to f's aux embeddings directly (what no attacker can do), its
    explained variance of f on the targets every `every` iterations."""
    _, train = split(ctx, seed)
    f_aux, f_target = ctx.clean_embeddings("aux"), ctx.clean_embeddings("target")
    start = cpu_seconds()
    with threads_for(ctx.aux.x.numel(), ctx.device):
        nets = SDARNets.build(ctx, seed, FULL, ctx.target.y, lr_scale=PRESET["lr_scale"], server_part="none")
        optimizer = nets.simulator_opt
        stream = BatchStream(len(train), PRESET["batch_size"], ctx.generator(seed + TRAINING_STREAM), train)
        for i in range(1, iterations + 1):
            pick = stream.next()
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(nets.simulator(ctx.aux.x[pick]), f_aux[pick]).backward()
            optimizer.step()
            if i % every == 0:
                residual = (simulated(nets, ctx.target.x) - f_target).pow(2).sum()
                explained = 1 - float(residual / (f_target - f_target.mean(0)).pow(2).sum())
                print(
                    f"  regress {i}: f's target variance explained by f~ {explained:.3f}; "
                    f"{cpu_seconds() - start:.0f} CPU s",
                    flush=True,
                )


def attack_run(ctx, label: str, regularizers, seed: int, iterations: int, every: int) -> None:
    """The attack's own training (sdar_reconstruct, never stopping), measured every `every` iterations."""
    observed = ctx.observed_embeddings("target", ctx.generator(seed))
    holdout, _ = split(ctx, seed)
    start = cpu_seconds()

    def measure(i: int, nets: SDARNets) -> None:
        if i % every == 0:
            report(label, i, ctx, nets, holdout, oracle=False, start=start)

    sdar_reconstruct(
        ctx,
        observed,
        ctx.target.y,
        seed,
        iterations,
        PRESET["batch_size"],
        regularizers,
        measure,
        simulator_init=PRESET["simulator_init"],
        lr_scale=PRESET["lr_scale"],
        server_part="none",
        stopping=Stopping(iterations, patience=iterations + 1, holdout_fraction=HOLDOUT),
    )


def print_nets(ctx) -> None:
    """Each layer of the decoder, d1 and d2 with its output shape on one sample."""
    nets = SDARNets.build(ctx, 0, FULL, ctx.target.y, server_part="none")
    x, z, y = ctx.aux.x[:2], ctx.clean_embeddings("aux")[:2], ctx.aux.y[:2]
    for name, net, inputs in (("decoder", nets.decoder, (z, y)), ("d1", nets.d1, (z, y)), ("d2", nets.d2, (x, y))):
        params = sum(p.numel() for p in net.parameters())
        print(f"{name} ({params:,} parameters):")
        hooks = [
            layer.register_forward_hook(
                lambda module, _, out: print(f"    {type(module).__name__:16s} -> {tuple(out.shape[1:])}")
            )
            for layer in net.body
            if not isinstance(layer, torch.nn.Sequential)
        ]
        with torch.no_grad(), evaluating(net):
            net(*inputs)
        for hook in hooks:
            hook.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="textline")
    parser.add_argument(
        "--controls", nargs="+", choices=["oracle", "full", "no_d1", "regress"], default=["oracle", "full"]
    )
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--nets", action="store_true", help="print the networks built for the shapes and stop")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model, aux, target = write_inputs(Path(tmp), args.shape, 400, 200)
        ctx = prepare_context(AuditOptions(model=str(model), aux=str(aux), target=str(target), seed=0).validate())
        if args.nets:
            print_nets(ctx)
            return
        guess = mean_guess_baseline(ctx.aux.x, ctx.target.x, ctx.space)["mse"]
        print(
            f"{args.shape}: embedding {tuple(ctx.encoder.output_shape)}, seed {args.seed}, cpu preset, no g, "
            f"targets' labels; mean-guess MSE {guess:.4f}; load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        calibrate(ctx, args.seed)
        for control in args.controls:
            if control == "oracle":
                oracle_run(ctx, args.seed, args.iterations, args.every)
            elif control == "regress":
                regress_run(ctx, args.seed, args.iterations, args.every)
            else:
                regularizers = FULL if control == "full" else ABLATIONS["mse_no_d1"]
                attack_run(ctx, control, regularizers, args.seed, args.iterations, args.every)


if __name__ == "__main__":
    main()
