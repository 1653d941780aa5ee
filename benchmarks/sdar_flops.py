"""Where one SDAR training iteration's work goes: floating-point operations per network.

The target is the 64 px ResNet stem's full audit in under 30 minutes on 2 CPU cores, and
SDAR is most of its estimate. Seconds depend on the machine and its load; operation counts do
not. This script builds the attack's own networks (`sdar_training`, batch 32 as the cpu preset)
for a bundled sample model or a tests/support/architectures.py stem on generated images, and counts
with torch's FlopCounterMode one whole iteration and one forward + backward pass of each
network on a batch (an iteration runs f~ once with and once without gradients, the decoder on
aux and on observed embeddings, d1 on simulated and observed embeddings, d2 on decoded and real
inputs). It prints GFLOP per iteration and each network's parameters and GFLOP per pass.

    python -m benchmarks.sdar_flops                                           # digits CNN with g
    python -m benchmarks.sdar_flops --architecture resnet --size 64 --width 64   # a ResNet-18 stem + layer1 at 64 px
    python -m benchmarks.sdar_flops --shape textline        # shapes_scale.py's text-line bottom, no g
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from torch.utils.flop_counter import FlopCounterMode

from benchmarks.sdar_stopping import context
from benchmarks.shapes_scale import SHAPES
from splitaudit.attacks.parts.sdar_training import Regularizers, sdar_training
from tests.support.architectures import ARCHITECTURES

BATCH = 32  # the cpu preset's batch


def gflop(step) -> float:
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return counter.get_total_flops() / 1e9


def profile(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ctx, name = context(args, Path(tmp))
        observed = ctx.observed_embeddings("target", ctx.generator(0))
        with sdar_training(ctx, observed, ctx.target.y, 0, BATCH, Regularizers()) as (nets, iteration, _):
            x, condition = ctx.aux.x[:BATCH], nets.condition(ctx.aux.y[:BATCH])
            z = nets.simulator(x).detach()
            passes = {  # network: (module, one forward + backward, its passes per iteration)
                "f~ (simulator)": (nets.simulator, lambda: nets.simulator(x).sum().backward(), "1 + 1 forward"),
                "f~^-1 (decoder)": (nets.decoder, lambda: nets.decoder(z, condition).sum().backward(), "2"),
                "d1 (embeddings)": (nets.d1, lambda: nets.d1(z, condition).sum().backward(), "2"),
                "d2 (inputs)": (nets.d2, lambda: nets.d2(x, condition).sum().backward(), "2"),
            }
            total = gflop(iteration)
            print(f"{name}; embedding {tuple(ctx.encoder.output_shape)}; batch {BATCH}")
            print(f"one iteration: {total:.2f} GFLOP")
            print(f"{'network':18} {'params':>10} {'fwd+bwd GFLOP':>14}  passes per iteration")
            for label, (net, step, runs) in passes.items():
                if net is not None:
                    params = sum(p.numel() for p in net.parameters())
                    print(f"{label:18} {params:>10,} {gflop(step):>14.2f}  {runs}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="digits_cnn", help="a bundled sample model's name (with its g)")
    parser.add_argument("--architecture", choices=list(ARCHITECTURES), help="a stem instead of a sample model")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="shapes_scale.py's bottom instead")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--samples", type=int, default=64)
    profile(parser.parse_args())
