"""`splitaudit run --attacks all` on a real-size bottom model, stage by stage.

The targets: `--quick` under 15 minutes on 2 CPU cores, `--full` under
30 minutes. The model: a ResNet-style bottom (ResNet-18
stem + layer1 from tests/support/architectures.py, width 64, random weights with trained-looking
BatchNorm statistics) at 3x64x64, exported with torch.onnx.export(dynamo=True), audited with
`--quick --attacks all` on 400 generated samples. It prints the measured wall time and peak resident memory of every stage (load, dFIL, prior, each attack,
reports).

The data are generated here, nothing is downloaded: smooth random colour fields (Gaussian noise
at 1/8 resolution, bilinearly upsampled) whose mean colour depends on the class (10 classes)
and whose brightness gradient depends on a binary sensitive attribute.

    python -m benchmarks.audit_scale [--size 64] [--samples 400] [--width 64] [--threads 2]
    python -m benchmarks.audit_scale --full [--workers auto] [--attack-option sdar.batch_size=32]
    python -m benchmarks.audit_scale --full --beside-quick    # full against quick, measured in one sitting

--beside-quick runs the quick battery first, then the full one on the same model and data, and
prints them side by side: each stage's wall and CPU seconds, and each attack's metric and advantage
over its baseline, with whether the full battery's attack is at least as strong as the quick one's
(its advantage no lower). Each run's up-front estimate is printed beside the stages it ran.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.demo_stages import StageClock, instrument, print_estimate, print_stages, quiet_cli_run, stage_totals
from tests.support.architectures import build, export_onnx

CLASSES = 10


def smooth_images(n: int, size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x in [0, 1], class labels, binary attribute): smooth random fields with class colours."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % CLASSES
    attr = torch.randint(0, 2, (n,), generator=gen)
    colours = torch.rand(CLASSES, 3, 1, 1, generator=gen)
    coarse = torch.randn(n, 3, max(2, size // 8), max(2, size // 8), generator=gen)
    field = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    ramp = torch.linspace(-1, 1, size).view(1, 1, 1, size) * (2 * attr.view(n, 1, 1, 1) - 1)
    x = (colours[y] + 0.15 * field + 0.1 * ramp).clamp(0, 1)
    return x.numpy().astype(np.float32), y.numpy(), attr.numpy()


def write_inputs(folder: Path, size: int, samples: int, width: int) -> tuple[Path, Path]:
    x, y, attr = smooth_images(samples, size)
    data = folder / "data.npz"
    np.savez(data, x=x, y=y, attr=attr)
    model = build("resnet", seed=0, width=width)
    onnx = export_onnx(model, torch.from_numpy(x[:2]), folder / "resnet_stem.onnx", exporter="dynamo")
    return onnx, data


def audit(args) -> None:
    torch.set_num_threads(args.threads)
    clock, results, estimates = StageClock(trace_python=False), [], []
    instrument(clock, results, estimates)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        model, data = write_inputs(folder, args.size, args.samples, args.width)
        prep = time.perf_counter() - start
        for full in [False, True] if args.beside_quick else [args.full]:
            first, found = len(clock.stages), len(estimates)
            exit_code, settings = run_battery(args, clock, model, data, folder / "report", full)
            print(
                f"splitaudit run {settings}: ResNet stem width {args.width} at 3x{args.size}x{args.size}, "
                f"{args.samples} samples, dynamo ONNX; torch threads {torch.get_num_threads()}, load average "
                f"{os.getloadavg()[0]:.1f}, exit code {exit_code}; data + export {prep:.1f} s (not in the audit)"
            )
            stages, result = clock.stages[first:], results[-1] if results else {}
            print_stages(stages, result)
            if len(estimates) > found:
                print_estimate(estimates[-1], stages)
            runs["full" if full else "quick"] = (stages, result)
            print(flush=True)
    if len(runs) == 2:
        print_side_by_side(runs)


def run_battery(args, clock: StageClock, model: Path, data: Path, out: Path, full: bool) -> tuple[int, str]:
    """`splitaudit run MODEL --aux DATA --attacks all` (--quick unless `full`) in this process; returns
    its exit code and its settings as typed (the output folder written OUT)."""
    argv = ["run", str(model), "--aux", str(data), "--attacks", "all", "--out", str(out)]
    argv += ["--format", "json", "--debug"] + ([] if full else ["--quick"])
    argv += ["--workers", args.workers] if args.workers else []
    for setting in args.attack_option:
        argv += ["--attack-option", setting]
    exit_code, output = quiet_cli_run(clock, argv)
    estimates = [line for line in output.splitlines() if "this audit may take" in line]
    print("\n".join(estimates) or "no up-front cost estimate was printed (estimated under 3 minutes)")
    return exit_code, " ".join(argv[4:]).replace(str(out), "OUT")


def print_side_by_side(runs: dict[str, tuple[list, dict]]) -> None:
    """The quick and the full battery's stages (wall and CPU seconds, an attack's seeds added up) and
    attacks (primary metric, advantage over the baseline; the full one at least as strong?)."""
    (quick_stages, quick), (full_stages, full) = runs["quick"], runs["full"]
    quick_totals, full_totals = stage_totals(quick_stages), stage_totals(full_stages)
    print(f"{'stage (all seeds)':36s} {'quick s':>8s} {'CPU s':>7s} {'full s':>8s} {'CPU s':>7s}")
    for name in dict.fromkeys([*quick_totals, *full_totals]):
        (qw, qc), (fw, fc) = quick_totals.get(name, (0.0, 0.0)), full_totals.get(name, (0.0, 0.0))
        print(f"{name:36s} {qw:8.1f} {qc:7.1f} {fw:8.1f} {fc:7.1f}")
    print(
        f"{'attack':22s} {'quick: metric':>24s} {'advantage':>10s} {'full: metric':>24s} {'advantage':>10s}  as strong"
    )
    for name, entry in full.get("attacks", {}).items():
        before = quick.get("attacks", {}).get(name, {})
        if "advantage" not in entry or "advantage" not in before:
            print(f"{name:22s} {before.get('status', ''):>24s} {'':10s} {entry.get('status', ''):>24s}")
            continue
        strong = "yes" if entry["advantage"] >= before["advantage"] else "NO"
        print(
            f"{name:22s} {headline(before):>24s} {before['advantage']:10.4f} {headline(entry):>24s} "
            f"{entry['advantage']:10.4f}  {strong}"
        )


def headline(entry: dict) -> str:
    """The primary metric's mean and its seeds ("mse 0.01448 (3)")."""
    metric = entry["primary_metric"]
    return f"{metric} {entry['metrics'][metric]:.4g} ({len(entry.get('seeds', []))})"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="the full settings (default: --quick)")
    parser.add_argument("--beside-quick", action="store_true", help="run --quick, then the full settings, side by side")
    parser.add_argument("--workers", help="the CLI's --workers (default: its own)")
    parser.add_argument(
        "--attack-option", action="append", default=[], help="the CLI's --attack-option NAME.KEY=VALUE (repeatable)"
    )
    audit(parser.parse_args())
