"""`splitaudit run --attacks all` on a real-size bottom model, stage by stage.

The targets: `--quick` under 15 minutes on 2 CPU cores, `--full` under
30 minutes. The model: a ResNet-style bottom (ResNet-18
stem + layer1 from tests/architectures.py, width 64, random weights with trained-looking
BatchNorm statistics) at 3x64x64, exported with torch.onnx.export(dynamo=True), audited with
`--quick --attacks all` on 400 generated samples. It prints the measured wall time and peak resident memory of every stage (load, dFIL, prior, each attack,
reports).

The data are generated here, nothing is downloaded: smooth random colour fields (Gaussian noise
at 1/8 resolution, bilinearly upsampled) whose mean colour depends on the class (10 classes)
and whose brightness gradient depends on a binary sensitive attribute.

    python benchmarks/audit_scale.py [--size 64] [--samples 400] [--width 64] [--threads 2]
    python benchmarks/audit_scale.py --full [--workers auto] [--attack-option sdar.batch_size=32]

"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from architectures import build, export_onnx  # noqa: E402
from demo_stages import StageClock, instrument, print_stages, quiet_cli_run  # noqa: E402

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
    clock, results = StageClock(trace_python=False), []
    instrument(clock, results)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        model, data = write_inputs(folder, args.size, args.samples, args.width)
        prep = time.perf_counter() - start
        argv = ["run", str(model), "--aux", str(data), "--attacks", "all", "--out", str(folder / "report")]
        argv += ["--format", "json", "--debug"] + ([] if args.full else ["--quick"])
        argv += ["--workers", args.workers] if args.workers else []
        for setting in args.attack_option:
            argv += ["--attack-option", setting]
        exit_code, output = quiet_cli_run(clock, argv)
        estimates = [line for line in output.splitlines() if "this audit may take" in line]
        print("\n".join(estimates) or "no up-front cost estimate was printed (estimated under 3 minutes)")
    settings = " ".join(argv[4:]).replace(str(folder / "report"), "OUT")
    print(
        f"splitaudit run {settings}: ResNet stem width {args.width} at 3x{args.size}x{args.size}, "
        f"{args.samples} samples, dynamo ONNX; torch threads {torch.get_num_threads()}, load average "
        f"{os.getloadavg()[0]:.1f}, exit code {exit_code}; data + export {prep:.1f} s (not in the audit)"
    )
    print_stages(clock.stages, results[0] if results else {})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="the full settings (default: --quick)")
    parser.add_argument("--workers", help="the CLI's --workers (default: its own)")
    parser.add_argument(
        "--attack-option", action="append", default=[], help="the CLI's --attack-option NAME.KEY=VALUE (repeatable)"
    )
    audit(parser.parse_args())
