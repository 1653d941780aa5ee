"""Seconds per SDAR iteration on Zhu et al.'s (NDSS 2025) CIFAR-10 ResNet-20 split at level 7, vs the paper's 0.17 s.

Zhu et al. (NDSS 2025; Sec. V-A, Table I, Fig. 16): ResNet-20 is a 3x3 conv stem (16 filters) and nine
residual blocks (three each of 16, 32 and 64 filters; the first block of the 32- and
64-filter stages has stride 2). Split level s puts the stem and the first s blocks on the
client: level 7 has 1 + 2*7 = 15 layers (Table I), so the embedding is 64x8x8 (Table IX's
level-7 decoder upsamples twice, 8 -> 16 -> 32). The server's g is the last two blocks,
global average pooling and the 10-way dense layer. The paper times about 0.17 s per
iteration at batch 128 on an A100 with TensorFlow (Sec. V, 20k iterations).

This runs the attack's own code (`SDARNets` and `sdar_iteration` from splitaudit's sdar attack)
on synthetic CIFAR-shaped data: f~ is the level-7 bottom model re-initialised, g a frozen
random top model. Not run by CI.

    python -m benchmarks.sdar_iteration [--iterations 20] [--warmup 3] [--device auto|cpu|cuda]
                                        [--preset paper|cpu] [--threads 2]

--preset paper (default) times the paper's batch of 128; cpu the attack's CPU batch. Prints
the wall and the process CPU seconds per iteration (on a shared CPU the wall time is noisy).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn as nn

from splitaudit.attacks.parts.sdar_training import FULL, BatchStream, SDARNets, sdar_iteration
from splitaudit.attacks.sdar import PRESETS
from splitaudit.context.audit_context import AuditContext
from splitaudit.inputs.data import Dataset
from splitaudit.inputs.models import Encoder, resolve_device

PAPER_SECONDS_PER_ITERATION = 0.17  # Zhu et al. (NDSS 2025), A100 80GB, TensorFlow
INPUT_SHAPE = (3, 32, 32)
CLASSES = 10
SAMPLES = 2048  # per part; timing does not depend on it
SPLIT_LEVEL = 7


class Block(nn.Module):
    """ResNet v1 basic block: conv-BN-ReLU-conv-BN plus the (projected) shortcut, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1),
            nn.BatchNorm2d(cout),
        )
        self.shortcut = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet20_split(level: int) -> tuple[nn.Sequential, nn.Sequential]:
    """(bottom f: stem + first `level` blocks, top g: the remaining blocks + pooling + dense)."""
    stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
    blocks, cin = [], 16
    for cout in (16, 32, 64):
        for i in range(3):
            blocks.append(Block(cin, cout, stride=2 if i == 0 and cout != 16 else 1))
            cin = cout
    bottom = nn.Sequential(stem, *blocks[:level])
    top = nn.Sequential(*blocks[level:], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, CLASSES))
    return bottom, top


def synthetic_context(device: torch.device) -> AuditContext:
    """An audit context for the level-7 split with random CIFAR-shaped data and labels."""
    torch.manual_seed(0)
    bottom, top = resnet20_split(SPLIT_LEVEL)
    bottom, top = bottom.to(device).eval(), top.to(device).eval()
    for p in top.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        output_shape = tuple(bottom(torch.zeros(1, *INPUT_SHAPE, device=device)).shape[1:])
    encoder = Encoder(
        path="resnet20-level7 (synthetic)",
        format="torchscript",
        input_shape=INPUT_SHAPE,
        output_shape=output_shape,
        device=device,
        torch_fn=bottom,
        blackbox_fn=bottom,
        fixed_batch=None,
        parity_max_abs_err=None,
        stochastic=False,
        warnings=[],
        providers=[],
    )

    def part() -> Dataset:
        return Dataset(
            x=torch.rand(SAMPLES, *INPUT_SHAPE, device=device), y=torch.randint(CLASSES, (SAMPLES,), device=device)
        )

    return AuditContext(encoder=encoder, aux=part(), target=part(), top_model=top)


def seconds_per_iteration(ctx: AuditContext, iterations: int, warmup: int, batch_size: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per iteration of the attack's own training step."""
    nets = SDARNets.build(ctx, seed=0, regularizers=FULL, known_labels=ctx.target.y)  # vanilla SL
    observed = ctx.observed_embeddings("target", ctx.generator(0))
    gen = ctx.generator(1)
    streams = (BatchStream(len(ctx.aux), batch_size, gen), BatchStream(len(observed), batch_size, gen))
    for _ in range(warmup):
        sdar_iteration(ctx, nets, observed, gen, streams)
    synchronize(ctx.device)
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(iterations):
        sdar_iteration(ctx, nets, observed, gen, streams)
    synchronize(ctx.device)
    return (time.perf_counter() - start) / iterations, (time.process_time() - cpu_start) / iterations


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--preset", default="paper", choices=sorted(PRESETS), help="batch size of this preset")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    ctx = synthetic_context(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    batch = PRESETS[args.preset]["batch_size"]
    seconds, cpu_seconds = seconds_per_iteration(ctx, args.iterations, args.warmup, batch)
    bottom_params = sum(p.numel() for p in ctx.encoder.torch_fn.parameters())
    print(
        f"ResNet-20 split level {SPLIT_LEVEL}: input {INPUT_SHAPE}, embedding {ctx.encoder.output_shape}, "
        f"bottom model {bottom_params:,} parameters (Table I: 124,912 counting BN's moving "
        f"statistics); batch {batch} (preset {args.preset})"
    )
    print(f"device: {device.type} ({name})")
    print(
        f"SDAR: {seconds:.4f} s per iteration over {args.iterations} iterations "
        f"(after {args.warmup} warm-up); process CPU {cpu_seconds:.4f} s per iteration; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"Zhu et al. (NDSS 2025) (A100, TensorFlow): {PAPER_SECONDS_PER_ITERATION} s per iteration; "
        f"ratio ours/paper = {seconds / PAPER_SECONDS_PER_ITERATION:.2f} "
        f"({'faster' if seconds < PAPER_SECONDS_PER_ITERATION else 'slower'})"
    )


if __name__ == "__main__":
    main()
