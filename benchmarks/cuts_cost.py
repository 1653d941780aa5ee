"""`splitaudit cuts` on a whole ResNet-18 at 64 px against N separate `splitaudit run`s of the same
bottoms, side by side.

The model is torchvision's ResNet-18 written out (conv 7x7/2, BatchNorm, ReLU, MaxPool 3x3/2, four
stages of two basic blocks at widths 64-128-256-512, global average pool, a linear head), with
random convolution weights and trained-looking BatchNorm statistics (tests/support/architectures.py's
`build` recipe), and a linear head fitted on its pooled features for a synthetic three-class task
(which quadrant of the image is bright), so the whole model has a real accuracy to lose. The data
is 3x64x64 images in [0, 1].

`cuts` is run once on the whole model; then each of its audited cuts is split by the same code
(splitaudit.inputs.onnx_cuts.split_at) and audited by `splitaudit run BOTTOM --top-model TOP` at the
sigma `cuts` used there, as a user would by hand. Both print their wall time; `cuts` shares the
prior term across cuts and runs each cut in one process, the separate runs each train their own.

    python -m benchmarks.cuts_cost                          # 4 cuts, --quick, prior ssm (~10-30 min on 2 cores)
    python -m benchmarks.cuts_cost --cuts 6 --prior gaussian --width 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def resnet18(width: int, classes: int):
    """torchvision's resnet18 layout at base width `width` (64 is ResNet-18 itself)."""
    import torch.nn as nn

    from tests.support.architectures import BasicBlock

    class ResNet18(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.relu = nn.ReLU()
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            stages, cin = [], width
            for stage, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
                stride = 1 if stage == 0 else 2
                stages.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout)))
                cin = cout
            self.layer1, self.layer2, self.layer3, self.layer4 = stages
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(cin, classes)

        def features(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.avgpool(x).flatten(1)

        def forward(self, x):
            return self.fc(self.features(x))

    return ResNet18()


def make_model_and_data(folder: Path, width: int, n: int, size: int, seed: int) -> tuple[Path, Path]:
    """The whole model (ONNX, legacy exporter) and labelled images; its head fitted on its features."""
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from tests.support.architectures import export_onnx

    torch.manual_seed(seed)
    y = torch.arange(n) % 3
    x = 0.4 * torch.rand(n, 3, size, size)
    half = size // 2
    x[y == 0, :, :half, :half] += 0.5
    x[y == 1, :, half:, half:] += 0.5
    x[y == 2, :, :half, half:] += 0.5
    model = resnet18(width, 3).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.1, 0.1)
        features = model.features(x)
    features = (features - features.mean(0)) / (features.std(0) + 1e-6)
    head = nn.Linear(features.shape[1], 3)
    optimizer = torch.optim.Adam(head.parameters(), 1e-2)
    for _ in range(300):
        optimizer.zero_grad()
        F.cross_entropy(head(features), y).backward()
        optimizer.step()
    with torch.no_grad():  # fold the standardisation into the model's own head
        raw = model.features(x)
        mean, std = raw.mean(0), raw.std(0) + 1e-6
        model.fc.weight.copy_(head.weight / std)
        model.fc.bias.copy_(head.bias - (head.weight * mean / std).sum(1))
        accuracy = float((model(x).argmax(1) == y).float().mean())
    print(
        f"whole model: ResNet-18 layout, width {width}, {size} px; head fitted: accuracy {accuracy:.3f} on {n} images"
    )
    np.savez(folder / "images.npz", x=x.numpy(), y=y.numpy())
    return export_onnx(model, x[:2], folder / "resnet18.onnx", exporter="legacy", opset=17), folder / "images.npz"


def timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        sys.exit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64, help="base width (64: ResNet-18)")
    parser.add_argument("--size", type=int, default=64, help="image size in pixels")
    parser.add_argument("--n", type=int, default=256, help="images (half aux, half target)")
    parser.add_argument("--cuts", default="4", help="--cuts for splitaudit cuts (a number or names)")
    parser.add_argument("--prior", default="ssm", choices=("ssm", "dsm", "gaussian"))
    parser.add_argument("--attacks", default="none")
    parser.add_argument("--dfil-samples", default="64")
    parser.add_argument("--target-mse", default="0.02")
    parser.add_argument("--no-runs", action="store_true", help="only `cuts`, not the separate runs")
    parser.add_argument("--keep", help="a folder to keep the model, data and reports in")
    args = parser.parse_args()

    folder = Path(args.keep or tempfile.mkdtemp(prefix="cuts-cost-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; files in {folder}")
    model, data = make_model_and_data(folder, args.width, args.n, args.size, seed=0)
    common = ["--aux", str(data), "--quick", "--prior", args.prior, "--attacks", args.attacks]
    common += ["--dfil-samples", args.dfil_samples]
    cli = [sys.executable, "-m", "splitaudit"]
    command = [*cli, "cuts", str(model), *common, "--cuts", args.cuts, "--target-mse", args.target_mse]
    cuts_seconds, done = timed([*command, "--out", str(folder / "cuts")])
    print(f"$ splitaudit {' '.join(command[3:])}\n{done.stdout}")
    print(f"splitaudit cuts: {cuts_seconds:.1f} s")
    if args.no_runs:
        return
    from splitaudit.inputs.onnx_cuts import candidate_cuts, open_whole_model

    document = json.loads((folder / "cuts" / "cuts.json").read_text())
    whole = open_whole_model(model, tuple(document["model"]["input_shape"]))
    points = {c.name: c for c in candidate_cuts(whole)}
    run_seconds = [
        _separate_run(cli, whole, points[cut["name"]], cut["noise_sigma"], common, folder / f"run{i}")
        for i, cut in enumerate(document["cuts"])
    ]
    print(f"\n{'cut':40s} {'cuts (share)':>14s} {'separate run':>14s}")
    for cut, seconds in zip(document["cuts"], run_seconds):
        print(f"{cut['name'][:40]:40s} {cut['seconds']:13.1f}s {seconds:13.1f}s")
    total = sum(run_seconds)
    print(f"{'total':40s} {cuts_seconds:13.1f}s {total:13.1f}s   separate/cuts = {total / cuts_seconds:.2f}")


def _separate_run(cli: list[str], whole, point, sigma: float, common: list[str], out: Path) -> float:
    """Seconds of `splitaudit run` on this cut's bottom with its top, at the sigma `cuts` audited it at."""
    seconds, _ = timed(separate_run_command(cli, whole, point, sigma, common, out))
    return seconds


def separate_run_command(cli: list[str], whole, point, sigma: float, common: list[str], out: Path) -> list[str]:
    """The cut's halves written in `out`, and the `splitaudit run` of its bottom with its top at `sigma`,
    as a user would audit that cut by hand."""
    import onnx

    from splitaudit.inputs.onnx_cuts import split_at

    out.mkdir(parents=True, exist_ok=True)
    paths = out / "bottom.onnx", out / "top.onnx"
    for half, path in zip(split_at(whole, point), paths):
        onnx.save(half, str(path))
    command = [*cli, "run", str(paths[0]), "--top-model", str(paths[1]), *common]
    return [*command, "--noise-sigma", repr(sigma), "--out", str(out)]


if __name__ == "__main__":
    main()
